//! Tensors across the boundary by DLPack (the legacy `dltensor` capsule every PyTorch ≥ 1.10 and
//! numpy ≥ 1.22 reads and writes), with no libtorch and no numpy linked.
//!
//! - [`Buffer`] hands odc's own memory out: `torch.from_dlpack(buffer)` and
//!   `numpy.from_dlpack(buffer)` view it without a copy. The capsule's manager holds a reference
//!   to the memory (`Arc<[f32]>`), so the view stays valid after the runtime, the micro-batch or
//!   the buffer object is gone; the memory is freed when the last of them lets go.
//! - With the GPU path (feature `cuda`, `crate::gpu`) a gathered unit in device memory goes out as
//!   a `kDLCUDA` view the same way ([`export`] with what keeps it alive), and a CUDA gradient
//!   comes in as a capsule held until its push is over ([`Capsule::consume_later`]).
//! - [`host_values`] reads a caller's tensor (anything with `__dlpack__`) into `f32`s: on the CPU,
//!   fp32 or bf16, contiguous, with exactly the expected element count; anything else is an
//!   error naming what was wrong (its dtype, device, shape or strides). The capsule is consumed
//!   as the protocol says: renamed `used_dltensor`, its deleter called once.
//!
//! Safety rests on the DLPack contract, checked where it can be: a capsule named `dltensor`
//! holds a `DLManagedTensor*` valid until its deleter runs; a producer's `shape`, `strides` and
//! `data` are valid for `ndim` dimensions while the capsule is unconsumed.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors;

const CAPSULE: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";
/// `kDLCPU`, `kDLCUDA`, `kDLCUDAHost` (pinned host memory, readable as host memory).
pub(crate) const CPU: i32 = 1;
pub(crate) const CUDA: i32 = 2;
const CUDA_HOST: i32 = 3;
/// Type codes: `kDLFloat`, `kDLBfloat`.
const FLOAT: u8 = 2;
const BFLOAT: u8 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct DLDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// fp32 and bf16, as DLPack names them.
pub(crate) const F32: DLDataType = DLDataType {
    code: FLOAT,
    bits: 32,
    lanes: 1,
};
pub(crate) const BF16: DLDataType = DLDataType {
    code: BFLOAT,
    bits: 16,
    lanes: 1,
};

#[repr(C)]
pub(crate) struct DLTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DLDevice,
    ndim: i32,
    pub(crate) dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    pub(crate) byte_offset: u64,
}

#[repr(C)]
pub(crate) struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What one exported capsule owns: the managed tensor first (its address is the whole's), its
/// shape, and what keeps the memory alive (`K`: the host values, or a device view).
#[repr(C)]
struct Exported<K> {
    managed: DLManagedTensor,
    shape: [i64; 1],
    _keep: K,
}

unsafe extern "C" fn delete_exported<K>(managed: *mut DLManagedTensor) {
    if !managed.is_null() {
        // SAFETY: `managed` is the first field of a leaked `Box<Exported<K>>` (see `export`),
        // and the protocol calls the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Exported<K>>()) });
    }
}

/// The capsule's destructor: a capsule never consumed still owns its tensor (its own deleter
/// frees it).
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the name tells whether a consumer took it.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE.as_ptr());
            let managed = managed.cast::<DLManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// A capsule holding a one-dimensional view of `len` elements of `dtype` at `data` on `device`,
/// kept valid by `keep` until the consumer lets it go.
pub(crate) fn export<K: Send + 'static>(
    py: Python<'_>,
    data: *mut c_void,
    device: DLDevice,
    dtype: DLDataType,
    len: usize,
    keep: K,
) -> PyResult<Py<PyAny>> {
    let mut exported = Box::new(Exported {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data,
                device,
                ndim: 1,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported::<K>),
        },
        shape: [len as i64],
        _keep: keep,
    });
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a valid, leaked `Exported`; the capsule's destructor or the consumer's
    // call of the deleter frees it, exactly once.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let capsule = ffi::PyCapsule_New(raw.cast(), CAPSULE.as_ptr(), Some(drop_capsule));
        if capsule.is_null() {
            delete_exported::<K>(raw.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule).unbind())
    }
}

/// odc's memory, one-dimensional fp32 on the CPU, for `torch.from_dlpack` or
/// `numpy.from_dlpack`: a view, not a copy, that keeps the memory alive as long as it is used.
#[pyclass(frozen, name = "Buffer", module = "odc")]
pub(crate) struct Buffer {
    values: Arc<[f32]>,
}

impl Buffer {
    pub(crate) fn new(values: Arc<[f32]>) -> Self {
        Buffer { values }
    }
}

#[pymethods]
impl Buffer {
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, max_version);
        if let Some((device, _)) = dl_device.filter(|(d, _)| *d != CPU) {
            return Err(PyBufferError::new_err(format!(
                "odc's buffer is host memory (DLPack device 1), not device {device}"
            )));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "odc's buffer is exported without a copy (copy=True is not offered)",
            ));
        }
        let host = DLDevice {
            device_type: CPU,
            device_id: 0,
        };
        let data = self.values.as_ptr() as *mut c_void;
        export(
            py,
            data,
            host,
            F32,
            self.values.len(),
            Arc::clone(&self.values),
        )
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (CPU, 0)
    }

    fn __len__(&self) -> usize {
        self.values.len()
    }

    /// The address of the first element (what a view's `data_ptr()` is).
    #[getter]
    fn address(&self) -> usize {
        self.values.as_ptr() as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "Buffer({} fp32 values at {:#x})",
            self.values.len(),
            self.address()
        )
    }
}

/// Dimensions of a tensor, for an error.
fn dims(t: &DLTensor) -> Vec<i64> {
    if t.ndim <= 0 || t.shape.is_null() {
        return Vec::new();
    }
    // SAFETY: the producer's `shape` holds `ndim` entries while the capsule is unconsumed.
    unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize).to_vec() }
}

/// Whether the tensor's elements are laid out one after another (row-major, or no strides).
fn contiguous(t: &DLTensor, shape: &[i64]) -> bool {
    if t.strides.is_null() {
        return true;
    }
    // SAFETY: as `dims`, `strides` holds `ndim` entries.
    let strides = unsafe { std::slice::from_raw_parts(t.strides, shape.len()) };
    let mut expected = 1i64;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(n);
    }
    true
}

/// Whether `d` is fp32.
pub(crate) fn is_f32(d: DLDataType) -> bool {
    (d.code, d.bits, d.lanes) == (FLOAT, 32, 1)
}

pub(crate) fn dtype_name(d: DLDataType) -> String {
    let kind = match d.code {
        0 => "int",
        1 => "uint",
        FLOAT => "float",
        BFLOAT => "bfloat",
        5 => "complex",
        6 => "bool",
        _ => "type code ",
    };
    match d.code {
        0..=6 => format!("{kind}{}", d.bits),
        code => format!("{kind}{code} of {} bits", d.bits),
    }
}

/// The values of `tensor` (anything with `__dlpack__`: a torch tensor, a numpy array) as `f32`,
/// checked to be fp32 or bf16 in host memory, contiguous, and `len` elements where given; `what`
/// names it in an error.
pub(crate) fn host_values(
    tensor: &Bound<'_, PyAny>,
    len: Option<usize>,
    what: &str,
) -> PyResult<Vec<f32>> {
    let capsule = Capsule::take(tensor, None, what)?;
    let values = read(capsule.tensor(), len, what);
    capsule.consume()?;
    values
}

/// The DLPack device `tensor` says it is on (`__dlpack_device__`), if it says.
pub(crate) fn device_of(tensor: &Bound<'_, PyAny>) -> PyResult<Option<(i32, i32)>> {
    if !tensor.hasattr("__dlpack_device__")? {
        return Ok(None);
    }
    Ok(tensor.call_method0("__dlpack_device__")?.extract().ok())
}

/// A producer's unused `dltensor` capsule, read in place and consumed exactly once.
pub(crate) struct Capsule<'py> {
    capsule: Bound<'py, PyAny>,
    managed: *mut DLManagedTensor,
}

impl<'py> Capsule<'py> {
    /// `tensor.__dlpack__()` (with `stream=` where given: the stream the consumer reads on),
    /// checked to be an unused `dltensor` capsule.
    pub(crate) fn take(
        tensor: &Bound<'py, PyAny>,
        stream: Option<usize>,
        what: &str,
    ) -> PyResult<Self> {
        if !tensor.hasattr("__dlpack__")? {
            return Err(errors::invalid(format!(
                "{what}: expected a tensor or an array (an object with __dlpack__), got {}",
                tensor.get_type().name()?
            )));
        }
        let capsule = match stream {
            None => tensor.call_method0("__dlpack__")?,
            Some(stream) => {
                let kwargs = pyo3::types::PyDict::new(tensor.py());
                kwargs.set_item("stream", stream)?;
                tensor.call_method("__dlpack__", (), Some(&kwargs))?
            }
        };
        let cap = capsule.as_ptr();
        // SAFETY: only a capsule named `dltensor` is read; its pointer is a `DLManagedTensor*`.
        let managed = unsafe {
            if ffi::PyCapsule_IsValid(cap, CAPSULE.as_ptr()) != 1 {
                return Err(errors::invalid(format!(
                    "{what}: __dlpack__ returned no unused `dltensor` capsule"
                )));
            }
            ffi::PyCapsule_GetPointer(cap, CAPSULE.as_ptr()).cast::<DLManagedTensor>()
        };
        Ok(Capsule { capsule, managed })
    }

    /// The producer's tensor, valid until the capsule is consumed.
    pub(crate) fn tensor(&self) -> &DLTensor {
        // SAFETY: valid until its deleter runs, which only `consume` does.
        unsafe { &(*self.managed).dl_tensor }
    }

    /// Consumed as the protocol says: renamed, then the deleter called once.
    fn consume(self) -> PyResult<()> {
        let managed = self.consume_later()?;
        // SAFETY: the renamed capsule no longer deletes it; this is the one call.
        unsafe {
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
        Ok(())
    }

    /// Renamed `used_dltensor` (the capsule no longer owns the tensor): the managed tensor,
    /// whose deleter the caller runs once, on a thread holding the GIL.
    pub(crate) fn consume_later(self) -> PyResult<*mut DLManagedTensor> {
        // SAFETY: renaming a live capsule.
        if unsafe { ffi::PyCapsule_SetName(self.capsule.as_ptr(), USED.as_ptr()) } != 0 {
            return Err(PyErr::fetch(self.capsule.py()));
        }
        Ok(self.managed)
    }
}

/// The checked copy of `t`'s elements.
fn read(t: &DLTensor, len: Option<usize>, what: &str) -> PyResult<Vec<f32>> {
    let device = t.device.device_type;
    if device != CPU && device != CUDA_HOST {
        return Err(errors::invalid(format!(
            "{what}: the tensor is on DLPack device {device}{}: this runtime's transport is on \
             the host and takes tensors in host memory (device 1, the CPU): call .cpu(), or \
             start the runtime on the GPU (odc.init(device=\"cuda\"))",
            if device == CUDA { " (CUDA)" } else { "" }
        )));
    }
    let len = check_layout(t, len, what)?;
    let d = t.dtype;
    let base = t.data.cast::<u8>().wrapping_add(t.byte_offset as usize);
    match (d.code, d.bits, d.lanes) {
        (FLOAT, 32, 1) => {
            // SAFETY: `len` contiguous f32s at `base`, checked above; read unaligned to be safe.
            let src = base.cast::<f32>();
            Ok((0..len)
                .map(|i| unsafe { src.add(i).read_unaligned() })
                .collect())
        }
        (BFLOAT, 16, 1) => {
            let src = base.cast::<u16>();
            // SAFETY: as above, `len` contiguous bf16 values.
            Ok((0..len)
                .map(|i| f32::from_bits(u32::from(unsafe { src.add(i).read_unaligned() }) << 16))
                .collect())
        }
        _ => Err(errors::invalid(format!(
            "{what}: dtype {} is not taken: odc takes fp32 or bf16",
            dtype_name(d)
        ))),
    }
}

/// Checks `t`'s shape (`len` elements where given), data pointer and contiguity: its element
/// count.
pub(crate) fn check_layout(t: &DLTensor, len: Option<usize>, what: &str) -> PyResult<usize> {
    let shape = dims(t);
    let count: i64 = shape.iter().product();
    if let Some(len) = len.filter(|&len| count != len as i64) {
        return Err(errors::invalid(format!(
            "{what}: the tensor has {count} elements (shape {shape:?}), the unit {len}"
        )));
    }
    let len = usize::try_from(count).unwrap_or(0);
    if t.data.is_null() && len > 0 {
        return Err(errors::invalid(format!(
            "{what}: the tensor has no data pointer"
        )));
    }
    if !contiguous(t, &shape) {
        return Err(errors::invalid(format!(
            "{what}: the tensor of shape {shape:?} is not contiguous (call .contiguous())"
        )));
    }
    Ok(len)
}
