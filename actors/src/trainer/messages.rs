//! The trainer's messages: its spec, what it reports ([`TrainerReport`]), and [`TrainerMsg`].
//!
//! Follows the control plane's rules ([`crate::messages`]): plain serializable data, no tensor
//! bytes, RPC replies last.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::directory::Directory;
use crate::policy::dispatch::Communication;
use crate::trainer::ContextConfig;

pub use odc_policy::assignment::{Assignment, MicroBatchDone};

/// What a trainer tells the supervisor after a micro-batch; a failed one carries the runtime's
/// [`Error`](crate::Error) (the policy's report, generic over it).
pub type TrainerReport = odc_policy::assignment::TrainerReport<crate::Error>;

/// What a trainer is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerSpec {
    /// The trainer's slot (its rank in collective mode).
    pub rank: u32,
    pub communication: Communication,
    pub context: ContextConfig,
    /// Where every shard lives: one directory shared by every trainer that pushes alike (a
    /// node's, with relayed pushes), not a copy each (its routes grow with units × servers).
    #[serde(with = "shared_directory")]
    pub directory: Arc<Directory>,
}

/// A shared [`Directory`] on the wire: its value (each process shares what it decoded).
pub(crate) mod shared_directory {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::directory::Directory;

    pub fn serialize<S: Serializer>(directory: &Arc<Directory>, s: S) -> Result<S::Ok, S::Error> {
        directory.as_ref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Directory>, D::Error> {
        Directory::deserialize(d).map(Arc::new)
    }
}

/// Messages of a trainer.
pub enum TrainerMsg {
    Run(Assignment),
}
