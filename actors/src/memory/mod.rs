//! What a trainer's transfers read and write, below the data paths that move them: the gathered
//! unit buffers and how many are alive ([`buffers`], I5), the trainer's device memory as a
//! transport sees it ([`device`]), and a transfer in flight ([`Transfer`]).
//!
//! Nothing here moves bytes or knows a data path: [`crate::datapath`] fills and drains these, and
//! [`crate::trainer`]'s context holds them.

use futures::future::BoxFuture;

use crate::error::Result;

pub mod buffers;
pub mod device;

pub use buffers::{Lease, UnitBuffers};
pub use device::{DeviceGrad, DeviceMemory, DeviceUnit, UnitValues};

/// A transfer in progress: a future the context spawns (prefetch) or awaits.
pub type Transfer<T> = BoxFuture<'static, Result<T>>;
