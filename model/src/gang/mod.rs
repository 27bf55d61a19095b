//! What a gang of trainers is (context parallelism over one sample): where its members' tokens
//! sit in the split sample ([`GangLayout`]) and how they pass tensors to each other
//! ([`GangLink`]; [`InProcessGang`] within one process, the trainers' transport in
//! `odc::compute::TransportLink`). The attention over a gang's ring is
//! [`crate::attention::ring`]; a member's piece of a packed micro-batch is
//! [`crate::GangPiece`].

mod layout;
mod link;

pub use layout::GangLayout;
pub use link::{GangLink, InProcessGang, InProcessLink, Pass, Tag};
