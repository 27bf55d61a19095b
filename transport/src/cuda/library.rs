//! The CUDA libraries as this backend loads them: whether the driver (`libcuda`) and NVRTC
//! (`libnvrtc`) are present, checked before any cudarc call that needs them (cudarc panics on a
//! missing library), and the error of a driver call that failed.
//!
//! Guarantees: [`check_driver`] and [`check_nvrtc`] only open and close the libraries (`dlopen`)
//! and, for the driver, initialise it once per process; without one the error is
//! [`TransportError::Unsupported`] whose text starts `no CUDA driver:` or `no NVRTC:`.

use std::sync::OnceLock;

use cudarc::driver::result;

use crate::TransportError;

/// The "no CUDA driver" error, `what` says which part is missing.
fn no_driver(what: &str) -> TransportError {
    TransportError::Unsupported {
        what: format!("no CUDA driver: {what}"),
    }
}

/// Whether a shared library named one of `names` loads in this process.
fn library_loads(names: &[&std::ffi::CStr]) -> bool {
    names.iter().any(|name| {
        // SAFETY: `name` is a NUL-terminated string; dlopen with RTLD_LAZY | RTLD_LOCAL runs the
        // library's initialisers (the CUDA driver and NVRTC have no harmful ones) and the handle
        // is closed at once. cudarc opens its own handle later.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                false
            } else {
                libc::dlclose(handle);
                true
            }
        }
    })
}

/// Whether the CUDA driver library (`libcuda.so.1`) is present and initialises; checked once
/// per process. Every entry point of the backend calls this before any cudarc call. Without a
/// driver the error is [`TransportError::Unsupported`] whose text starts `no CUDA driver:`.
pub fn check_driver() -> Result<(), TransportError> {
    static CHECKED: OnceLock<Result<(), TransportError>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            if !library_loads(&[c"libcuda.so.1", c"libcuda.so"]) {
                return Err(no_driver(
                    "libcuda.so.1 does not load (no NVIDIA driver on this machine, or it is not \
                     on the library path)",
                ));
            }
            result::init().map_err(|e| no_driver(&format!("cuInit failed: {e}")))?;
            let count = result::device::get_count()
                .map_err(|e| no_driver(&format!("cuDeviceGetCount failed: {e}")))?;
            if count <= 0 {
                return Err(no_driver("the driver sees no CUDA device"));
            }
            Ok(())
        })
        .clone()
}

/// Whether NVRTC (`libnvrtc.so`, from the CUDA toolkit) loads; the kernels need it.
pub(crate) fn check_nvrtc() -> Result<(), TransportError> {
    if library_loads(&[c"libnvrtc.so.13", c"libnvrtc.so", c"libnvrtc.so.12"]) {
        Ok(())
    } else {
        Err(TransportError::Unsupported {
            what: "no NVRTC: libnvrtc.so does not load (the CUDA toolkit's lib64, e.g. \
                   /usr/local/cuda/lib64, is not on LD_LIBRARY_PATH); the accumulate kernels \
                   are compiled with it"
                .into(),
        })
    }
}

/// A driver call that failed: `what` it was, and the driver's error.
pub(crate) fn failed(what: &str, error: result::DriverError) -> TransportError {
    TransportError::Unsupported {
        what: format!("cuda: {what} failed: {error}"),
    }
}
