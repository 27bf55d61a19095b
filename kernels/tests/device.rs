//! The kernels through NVRTC and, where a GPU is, on it (feature `nvrtc`).
//!
//! - [`every_kernel_compiles_with_nvrtc`]: each source compiles for compute capabilities 8.0 and
//!   9.0 and its PTX has every listed kernel. Without NVRTC it says it was skipped, unless
//!   `ODC_REQUIRE_NVRTC=1` (CI), where that fails. With `ODC_PTXAS` naming a `ptxas` (CI: from
//!   NVIDIA's nvcc wheel), each PTX is also assembled for its compute capability, which checks
//!   what NVRTC passes through unread (inline PTX such as `mma.sync`), and each kernel's
//!   registers, spills and shared memory are printed.
//! - The device tests are `cases`' checks on the GPU (`emulated.rs` runs the same checks on the
//!   CPU). Without a driver each says it was skipped (`benches/gpu/run.sh` counts that as a
//!   failure on a GPU machine).
#![cfg(feature = "nvrtc")]

use odc_kernels::nvrtc::ptx;
use odc_kernels::SOURCES;
use odc_transport::cuda::{check_driver, Device, DeviceLauncher};
use rand::rngs::StdRng;

mod cases;

#[test]
fn every_kernel_compiles_with_nvrtc() {
    for source in SOURCES {
        for capability in [(8, 0), (9, 0)] {
            match ptx(&source, capability) {
                Ok(ptx) => {
                    for function in source.functions {
                        assert!(
                            ptx.contains(function),
                            "{} for {capability:?}: no {function} in the PTX",
                            source.name
                        );
                    }
                    if let Some(ptxas) = std::env::var_os("ODC_PTXAS") {
                        assemble(&ptxas, source.name, &ptx, capability);
                    }
                }
                Err(odc_kernels::nvrtc::KernelError(what))
                    if what.starts_with("no NVRTC")
                        && std::env::var_os("ODC_REQUIRE_NVRTC").is_none() =>
                {
                    eprintln!("skipped: {what}");
                    return;
                }
                Err(e) => panic!("{} does not compile for {capability:?}: {e}", source.name),
            }
        }
    }
}

/// `ptx` assembled by `ptxas` for `capability`: fails with ptxas's complaint; prints its
/// per-kernel lines (registers, spills, shared memory).
fn assemble(ptxas: &std::ffi::OsStr, name: &str, ptx: &str, capability: (i32, i32)) {
    let dir = std::env::temp_dir().join(format!("odc-kernels-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for ptxas");
    let file = dir.join(format!("{name}.{}{}.ptx", capability.0, capability.1));
    std::fs::write(&file, ptx).expect("writing the PTX");
    let output = std::process::Command::new(ptxas)
        .arg(format!("--gpu-name=sm_{}{}", capability.0, capability.1))
        .args(["-v", "-o"])
        .arg(dir.join("out.cubin"))
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.to_string_lossy()));
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} for {capability:?}: ptxas refuses its PTX:\n{log}"
    );
    for line in log
        .lines()
        .filter(|l| l.contains("entry function") || l.contains("Used") || l.contains("spill"))
    {
        println!(
            "{name} sm_{}{}: {}",
            capability.0,
            capability.1,
            line.trim()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The device and a seeded generator, or `None` (said) without a driver.
fn gpu(test: &str) -> Option<(DeviceLauncher, StdRng)> {
    if let Err(e) = check_driver() {
        eprintln!("skipped `{test}`: {e}");
        return None;
    }
    let rng = cases::seeded(test);
    let device = Device::open(0).unwrap_or_else(|e| panic!("device 0: {e}"));
    Some((DeviceLauncher(device), rng))
}

every_case!(gpu);
