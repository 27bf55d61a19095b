"""The GPU path where no GPU is (its device rows run in benches/gpu/python.sh): asking for it
names what is missing, a CUDA tensor never passes for host memory, and the host path counts the
bytes it moves through host memory (what the GPU path's figure says is 0)."""

import ctypes
import ctypes.util
import shutil

import numpy as np
import pytest
from test_trainer import UNIT, sgd_runtime, train

import odc


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class FakeCudaTensor:
    """A DLPack producer that says its fp32 values are on CUDA device 0 (the address is never
    read: a host runtime must refuse it before)."""

    def __init__(self, n):
        self.shape = (ctypes.c_int64 * 1)(n)
        self.managed = DLManagedTensor()
        self.managed.dl_tensor.data = 0x1000
        self.managed.dl_tensor.device = DLDevice(2, 0)
        self.managed.dl_tensor.ndim = 1
        self.managed.dl_tensor.dtype = DLDataType(2, 32, 1)
        self.managed.dl_tensor.shape = self.shape

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, **_):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)


def test_a_cuda_gradient_on_a_host_runtime_is_named_not_read():
    rt = sgd_runtime(trainers=1, servers=1)
    step = rt.step([4])
    mb = next(iter(step))
    assert not mb.on_device
    mb.gather("w")
    with pytest.raises(odc.InvalidArgument, match=r"DLPack device 2 \(CUDA\).*\.cpu\(\)"):
        mb.push("w", FakeCudaTensor(UNIT))
    mb.push("w", np.zeros(UNIT, dtype=np.float32))
    mb.finish(0.0)
    assert list(step) == []
    rt.close()


def test_the_host_path_counts_its_host_bytes():
    rt = sgd_runtime(trainers=1, servers=1)
    assert rt.device == "cpu" and rt.host_bytes == 0
    (stats,) = train(rt, [[3, 5]])
    # Each micro-batch gathers the unit and pushes its gradient, 4 bytes an element each.
    assert rt.host_bytes == stats["micro_batches"] * 2 * UNIT * 4
    rt.close()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "gpu"])
def test_a_device_odc_does_not_know_is_named(device):
    with pytest.raises(odc.InvalidArgument, match='expected "cpu", "cuda" or "cuda:N"'):
        sgd_runtime(device=device)


def test_cuda_without_a_driver_is_named_before_any_driver_call():
    if shutil.which("nvidia-smi") or ctypes.util.find_library("cuda"):
        pytest.skip("this machine has a CUDA driver: the GPU rows are benches/gpu/python.sh")
    with pytest.raises(odc.InvalidArgument, match='device "cuda".*no CUDA driver'):
        sgd_runtime(device="cuda")
