"""Makes a virtual environment holding exactly the requirements of a file, unless it has them.

``python3 python/env/make.py DIR REQUIREMENTS`` — the one way odc's environments are made: by
``tests/python.rs`` (``tools.txt``: maturin; ``test.txt``: what the package's tests import) and by
``.ci/run``, which makes ``test.txt``'s in the background while the lints build, so that the test
finds it made. ``DIR/odc-requirements.txt`` holds the file's text once the install succeeded;
a different text (or none) makes the environment again. Exit status 0: made or already there;
3: the package registry could not install the requirements; anything else: another failure.
Every step has a deadline.
"""

import shutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 3:
        print(f"usage: {sys.argv[0]} DIR REQUIREMENTS", file=sys.stderr)
        return 2
    env, requirements = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = requirements.read_text()
    stamp = env / "odc-requirements.txt"
    python = env / "bin" / "python"
    if stamp.exists() and stamp.read_text() == wanted and python.exists():
        return 0
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    try:
        subprocess.run([*pip, "-r", str(requirements)], check=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"cannot install {requirements} from the package registry: {e}", file=sys.stderr)
        return 3
    stamp.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
