//! Multi-process jobs as users run them: `examples/embed` in real processes (started by
//! `odc launch`, or by hand here to kill one of them), over real transports (`tcp`, `shm`), each
//! rank in its own network namespace where the machine allows it.
//!
//! Tolerance (I3): a multi-process job sums the same per-micro-batch gradients as one process,
//! in whatever order they arrive, in fp32; every final parameter must equal the single-process
//! run's within `1e-5` absolute (the parameters are O(1); reordering fp32 sums moves them by
//! ~1e-7), and the loss within `1e-9` relative (it is summed in f64).

mod failures;
mod harness;
mod netns;
mod parity;
