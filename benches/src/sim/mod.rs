//! Pure, deterministic models for the at-scale projection: data and functions only (no tokio, no
//! actors), so that the virtual-time runner and the planning studies price work the same way.
//!
//! - [`profile`]: what a micro-batch costs on one device (per-layer forward + backward time against
//!   tokens, from PAPERS.md's H100 table or an `odc-bench calibrate` profile), and the bytes of a
//!   layer;
//! - [`topology`]: nodes × GPUs, NVLink and NIC links as bandwidth + latency FIFO queues, the time of
//!   a set of point-to-point transfers, the NCCL-like ring collective, control latency, HPZ and
//!   Zeppelin-style routing;
//! - [`ports`]: the same links as an online schedule, for the runtime's transfers in arrival order
//!   (what [`crate::links`] puts under a virtual-time job);
//! - [`split`]: the long-sequence planning policy (context-parallel splitting of the sequences one
//!   device cannot finish in the balanced step) and its bounds;
//! - [`noise`]: costs the planner cannot see (estimate errors, kernel jitter, stragglers), and
//!   each side's step as the run pays them, lockstep or on demand;
//! - [`report`]: step time with and without splitting against perfect balance, per workload and
//!   device count, and that table joined to the runtime's rows;
//! - [`plot`]: `odc-bench sim --plot`, speedup against devices (runtime rows and the split table).
//!
//! Guarantees: every function here but [`plot::write`] (which writes its SVG) is a pure function of
//! its arguments (no clocks, no global state, no hash-map iteration order in any output); bad input
//! from a file or a user is a typed error naming what was wrong, never a panic.

pub mod noise;
pub mod plot;
pub mod ports;
pub mod profile;
pub mod report;
pub mod split;
pub mod topology;
