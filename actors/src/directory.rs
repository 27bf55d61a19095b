//! Where each shard of each unit lives: the region handles trainers address.

use std::ops::Range;

use odc_transport::{EndpointId, RegionHandle};

/// One shard of one unit: its owner, its element range within the unit and its two regions.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardRoute {
    pub owner: EndpointId,
    /// Elements of the unit this shard holds.
    pub range: Range<usize>,
    /// Published parameter copy (bf16 or fp32) trainers read.
    pub published: RegionHandle,
    /// fp32 gradient accumulator trainers add into.
    pub accumulator: RegionHandle,
}

/// Routes of every unit, in unit order; shards in owner order, empty shards left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Directory {
    pub units: Vec<Vec<ShardRoute>>,
}
