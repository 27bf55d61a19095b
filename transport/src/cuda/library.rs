//! The CUDA driver as this backend loads it: whether `libcuda` is present, checked before any
//! cudarc call that needs it (cudarc panics on a missing library), and the error of a driver
//! call that failed. (NVRTC is odc-kernels' to check: `odc_kernels::nvrtc::check_nvrtc`.)
//!
//! Guarantees: [`check_driver`] only opens and closes the library (`dlopen`) and initialises the
//! driver once per process; without one the error is [`TransportError::Unsupported`] whose text
//! starts `no CUDA driver:`.

use std::sync::OnceLock;

use cudarc::driver::result;
use odc_kernels::nvrtc::library_loads;

use crate::TransportError;

/// The "no CUDA driver" error, `what` says which part is missing.
fn no_driver(what: &str) -> TransportError {
    TransportError::Unsupported {
        what: format!("no CUDA driver: {what}"),
    }
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

/// A driver call that failed: `what` it was, and the driver's error.
pub(crate) fn failed(what: &str, error: result::DriverError) -> TransportError {
    TransportError::Unsupported {
        what: format!("cuda: {what} failed: {error}"),
    }
}
