//! Where each shard of each unit lives: the region handles trainers address. Plain serializable
//! data, gathered from the servers' routes once per job.

use std::ops::Range;

use odc_transport::{EndpointId, RegionHandle};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::UnitId;

/// One shard of one unit: its owner, its element range within the unit and its regions (a frozen
/// unit's shard has no accumulator).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardRoute {
    pub unit: UnitId,
    pub owner: EndpointId,
    /// First element of the unit this shard holds.
    pub start: u64,
    /// One past its last element.
    pub end: u64,
    /// Published parameter copy (bf16 or fp32) trainers read.
    pub published: RegionHandle,
    /// fp32 gradient accumulator trainers add into; `None` for a frozen unit
    /// ([`UnitSpec::frozen`](crate::layout::UnitSpec::frozen)), which takes no gradient.
    pub accumulator: Option<RegionHandle>,
}

impl ShardRoute {
    /// Elements of the unit this shard holds.
    pub fn range(&self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// Routes of every unit, in unit order; shards in unit-coordinate order, empty shards left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Directory {
    pub units: Vec<Vec<ShardRoute>>,
}

impl Directory {
    /// The directory of a model of `units` units from every server's routes (any order). Routes
    /// naming a unit outside the model are refused.
    pub fn from_routes(units: usize, routes: impl IntoIterator<Item = ShardRoute>) -> Result<Self> {
        let mut directory = Directory {
            units: vec![Vec::new(); units],
        };
        for route in routes {
            let unit = route.unit;
            let list = directory
                .units
                .get_mut(unit as usize)
                .ok_or(Error::UnknownUnit {
                    unit,
                    units: units as u64,
                })?;
            list.push(route);
        }
        for list in &mut directory.units {
            list.sort_by_key(|r| r.start);
        }
        Ok(directory)
    }

    /// The routes of `unit`.
    pub fn routes(&self, unit: UnitId) -> Result<&[ShardRoute]> {
        self.units
            .get(unit as usize)
            .map(Vec::as_slice)
            .ok_or(Error::UnknownUnit {
                unit,
                units: self.units.len() as u64,
            })
    }
}
