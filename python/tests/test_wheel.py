"""The installed wheel: imported from the environment's site-packages, with no Rust toolchain."""

import pathlib
import shutil
import sys
import sysconfig

import odc


def test_the_package_is_the_installed_wheel_and_needs_no_rust():
    site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
    here = pathlib.Path(odc.__file__).resolve()
    assert site in here.parents, f"odc imported from {here}, not from {site}"
    extension = pathlib.Path(odc._odc.__file__).name
    assert extension.endswith(".abi3.so"), extension
    assert shutil.which("cargo") is None and shutil.which("rustc") is None
    assert sys.version_info >= (3, 9)
    assert odc.__version__.count(".") == 2
