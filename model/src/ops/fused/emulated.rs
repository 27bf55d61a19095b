//! The fused kernels on this CPU (feature `emulate`): the same CUDA C compiled as C++ by the
//! host's compiler and run by `odc_kernels::emulate` (a block's threads as fibers, every launch
//! in two thread orders that must agree), so the model's fused path — its layouts, launches and
//! backward wiring — is checked where no GPU is (`tests/fused_kernels_on_cpu.rs`).
//!
//! Guarantees:
//! - Off until [`emulate_on_cpu`] gives it an emulator; then every CPU tensor the ops take
//!   (fp32, bf16) runs the kernels, as CUDA tensors do with `ODC_FUSED_KERNELS=1`.
//! - Inputs are copied into host buffers, outputs start as NaNs (an element no kernel writes
//!   shows), and each becomes a CPU tensor after its op's launches.
//! - A kernel that does not compile, parts a warp, or depends on its threads' order is an error
//!   naming it.

use std::sync::{Mutex, OnceLock};

use candle_core::{Error, Result};
use odc_kernels::emulate::{self, Emulator};
use odc_kernels::launch::Launcher;
use odc_kernels::Source;

use super::buf::{Arg, Buf};

static EMULATOR: Mutex<Option<Emulator>> = Mutex::new(None);

/// Runs the fused kernels on CPU tensors through `emulator` from now on (`None`: candle's ops
/// again). For tests: a process-wide switch, so a test binary that flips it runs one test at a
/// time through it.
pub fn emulate_on_cpu(emulator: Option<Emulator>) {
    *EMULATOR.lock().unwrap_or_else(|e| e.into_inner()) = emulator;
}

/// The emulator while [`emulate_on_cpu`] holds one; else, with `ODC_FUSED_KERNELS=emulate`, the
/// host's compiler (found once per process): a whole program (`sft`, `rl_grpo`) built with the
/// `emulate` feature then runs the GPU's fused path on the CPU.
pub(super) fn emulator() -> Option<Emulator> {
    let set = EMULATOR.lock().unwrap_or_else(|e| e.into_inner()).clone();
    set.or_else(|| from_env().clone())
}

/// Whether [`emulator`] has one (asked for every op on a CPU tensor: no clone).
pub(super) fn emulating() -> bool {
    EMULATOR.lock().unwrap_or_else(|e| e.into_inner()).is_some() || from_env().is_some()
}

/// The host's compiler when `ODC_FUSED_KERNELS=emulate`, found once per process.
fn from_env() -> &'static Option<Emulator> {
    static FROM_ENV: OnceLock<Option<Emulator>> = OnceLock::new();
    FROM_ENV.get_or_init(|| {
        let asked = std::env::var("ODC_FUSED_KERNELS").is_ok_and(|v| v == "emulate");
        let found = asked.then(Emulator::find).flatten();
        if asked && found.is_none() {
            eprintln!(
                "ODC_FUSED_KERNELS=emulate: no C++ compiler ($CXX, c++, g++) to run the \
                 kernels on the CPU; candle's ops run instead"
            );
        }
        found
    })
}

/// Runs `function` of `source` over `n` work items with `args`, through the emulator as
/// odc-kernels' one [`Launcher`] (the source compiled once per process).
pub(super) fn launch(
    emulator: &Emulator,
    source: &Source,
    function: &str,
    n: usize,
    args: &[Arg<'_>],
) -> Result<()> {
    let failed = |e: String| Error::Msg(format!("fused kernels on the CPU: {e}"));
    let module = Launcher::module(emulator, source).map_err(failed)?;
    let mut words = Vec::with_capacity(args.len());
    for arg in args {
        words.push(match *arg {
            Arg::Buffer(Buf::Host(host)) => emulate::Arg::Buffer(&host.buffer),
            #[allow(unreachable_patterns)]
            Arg::Buffer(_) => {
                return Err(Error::Msg("fused kernels: a CUDA tensor on the CPU".into()))
            }
            Arg::U64(v) => emulate::Arg::U64(v),
            Arg::I32(v) => emulate::Arg::I32(v),
            Arg::F32(v) => emulate::Arg::F32(v),
            Arg::F64(v) => emulate::Arg::F64(v),
        });
    }
    // SAFETY: the ops pass `function`'s parameters in order and of their types, each buffer
    // holding every element the kernel indexes for its `n`, as on CUDA.
    unsafe { Launcher::launch(emulator, &module, function, n, &words) }.map_err(failed)
}
