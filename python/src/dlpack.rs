//! Tensors across the boundary by DLPack (the legacy `dltensor` capsule every PyTorch ≥ 1.10 and
//! numpy ≥ 1.22 reads and writes), with no libtorch and no numpy linked.
//!
//! - [`Buffer`] hands odc's own memory out: `torch.from_dlpack(buffer)` and
//!   `numpy.from_dlpack(buffer)` view it without a copy. The capsule's manager holds a reference
//!   to the memory (`Arc<[f32]>`), so the view stays valid after the runtime, the micro-batch or
//!   the buffer object is gone; the memory is freed when the last of them lets go.
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
/// `kDLCPU`, `kDLCUDAHost` (pinned host memory, readable as host memory).
const CPU: i32 = 1;
const CUDA_HOST: i32 = 3;
/// Type codes: `kDLFloat`, `kDLBfloat`.
const FLOAT: u8 = 2;
const BFLOAT: u8 = 4;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What one exported capsule owns: the managed tensor first (its address is the whole's), its
/// shape, and the reference that keeps the memory alive.
#[repr(C)]
struct Exported {
    managed: DLManagedTensor,
    shape: [i64; 1],
    _values: Arc<[f32]>,
}

unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    if !managed.is_null() {
        // SAFETY: `managed` is the first field of a leaked `Box<Exported>` (see `export`), and
        // the protocol calls the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Exported>()) });
    }
}

/// The capsule's destructor: a capsule never consumed still owns its tensor.
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the name tells whether a consumer took it.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE.as_ptr());
            delete_exported(managed.cast());
        }
    }
}

/// A capsule holding a one-dimensional fp32 view of `values`.
fn export(py: Python<'_>, values: &Arc<[f32]>) -> PyResult<Py<PyAny>> {
    let mut exported = Box::new(Exported {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: values.as_ptr() as *mut c_void,
                device: DLDevice {
                    device_type: CPU,
                    device_id: 0,
                },
                ndim: 1,
                dtype: DLDataType {
                    code: FLOAT,
                    bits: 32,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape: [values.len() as i64],
        _values: Arc::clone(values),
    });
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a valid, leaked `Exported`; the capsule's destructor or the consumer's
    // call of the deleter frees it, exactly once.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let capsule = ffi::PyCapsule_New(raw.cast(), CAPSULE.as_ptr(), Some(drop_capsule));
        if capsule.is_null() {
            delete_exported(raw.cast());
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
        export(py, &self.values)
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

fn dtype_name(d: DLDataType) -> String {
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
    if !tensor.hasattr("__dlpack__")? {
        return Err(errors::invalid(format!(
            "{what}: expected a tensor or an array (an object with __dlpack__), got {}",
            tensor.get_type().name()?
        )));
    }
    let capsule = tensor.call_method0("__dlpack__")?;
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
    // SAFETY: valid until its deleter runs, which only `consume` below does.
    let t = unsafe { &(*managed).dl_tensor };
    let values = read(t, len, what)?;
    // SAFETY: consumed as the protocol says: renamed, then the deleter called once.
    unsafe {
        if ffi::PyCapsule_SetName(cap, USED.as_ptr()) != 0 {
            return Err(PyErr::fetch(tensor.py()));
        }
        if let Some(deleter) = (*managed).deleter {
            deleter(managed);
        }
    }
    Ok(values)
}

/// The checked copy of `t`'s elements.
fn read(t: &DLTensor, len: Option<usize>, what: &str) -> PyResult<Vec<f32>> {
    let device = t.device.device_type;
    if device != CPU && device != CUDA_HOST {
        return Err(errors::invalid(format!(
            "{what}: the tensor is on DLPack device {device}: odc's host transports take tensors \
             in host memory (device 1, the CPU)"
        )));
    }
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
