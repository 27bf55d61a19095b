//! Multi-process jobs as users run them: `examples/embed` in real processes (started by
//! `odc launch`, or by hand here to kill one of them), over real transports (`tcp`, `shm`), each
//! rank in its own network namespace where the machine allows it; `examples/sft` restarted by
//! `odc launch --max-restarts` after a rank is killed, also during a relay's flush (`restart.rs`,
//! its own tolerance);
//! `examples/sft --model-dir` on a Hugging Face directory every rank opens (`model_dir.rs`);
//! `examples/rl_grpo` sampling a share of the groups on every rank (`grpo.rs`); `examples/sft`
//! checkpointing into per-host directories and resuming from them (`per_host.rs`); `examples/sft
//! --split auto` splitting long samples over trainers in two processes (`split.rs`); pushes
//! relayed through the node over `shm` (`parity.rs`) and between two namespaces standing for
//! hosts (`netns.rs`).
//!
//! Tolerance (I3): a multi-process job sums the same per-micro-batch gradients as one process,
//! in whatever order they arrive, in fp32; every final parameter must equal the single-process
//! run's within `1e-5` absolute (the parameters are O(1); reordering fp32 sums moves them by
//! ~1e-7 per step), and the loss within `1e-6` relative (dynamic dispatch changes which trainer
//! sums which micro-batch from run to run, so even two single-process runs differ in the last bits).

mod failures;
#[cfg(feature = "candle")]
mod grpo;
mod harness;
mod hostile;
#[cfg(feature = "candle")]
mod model_dir;
mod netns;
mod parity;
#[cfg(feature = "candle")]
mod per_host;
#[cfg(feature = "candle")]
mod restart;
#[cfg(feature = "candle")]
#[path = "../common/sft_toml.rs"]
mod sft_toml;
#[cfg(feature = "candle")]
mod split;
