//! Gradient pushes relayed through the node: which shard server of a node takes that node's
//! pushes for a shard whose owner sits on another node (issue 43, item 2).
//!
//! Without relays every trainer pushes each unit's gradient straight into every owner's
//! accumulator, so a node of `g` trainers sends `g` copies of its off-node gradient over its NICs
//! per micro-batch. With them, a trainer pushes an off-node shard into its own node's **relay**
//! for that shard (over NVLink or shared memory), and the relay crosses the NIC once per step:
//! its flush at the barrier.
//!
//! Guarantees (tested):
//! - **one relay per (node, off-node owner)**, on the relaying node ([`RelayPlan::relay`]); none
//!   for an owner on the trainer's own node, and none on a node without servers (its trainers
//!   push straight to the owners, as without relays);
//! - **rail-aligned**: the relay of owner `m` is the server at `m`'s position among its node's
//!   servers (modulo the relaying node's count), so with one server per GPU each flush stays on
//!   one rail, as NCCL's PXN does;
//! - [`RelayPlan::relays_of`] is the inverse: the owners a server relays for.
//!
//! Exactly once (I2) is the data path's: a relay admits and deduplicates writes as the owner
//! would (same epoch fence, write ids and tokens), and its flush is one write per chunk under a
//! write id of its own ([`RELAY_MICRO_BATCH_BASE`]), so every admitted gradient is counted once
//! at the relay and its sum once at the owner; a discarded attempt discards the relays too.
//!
//! **The ledger's count travels with the flush** ([`Combined`], [`RelayPlan::check_combined`]):
//! each flush names the micro-batches whose writes its relay combined, and before any owner
//! reduces, the supervisor checks them against the ledger: every one done in this attempt by a
//! trainer of the relay's node and, on demand (where every micro-batch pushes every shard),
//! every such micro-batch present. A relay that lost, gained or misplaced one fails the check
//! ([`FlushMismatch`]) and the attempt is discarded and replayed (`crate::step`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Micro-batch numbers from here up name relays, not micro-batches: relay `s`'s flush writes
/// carry micro-batch `RELAY_MICRO_BATCH_BASE + s` in their write ids and that number's token.
/// A micro-batch number is an index into one minibatch's micro-batches, far below this (each
/// holds at least one token of a sample the job holds in memory).
pub const RELAY_MICRO_BATCH_BASE: u32 = 1 << 31;

/// Where every trainer and shard server of a job sits, by node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayPlan {
    /// The node of each shard server, by endpoint.
    pub server_nodes: Vec<u32>,
    /// The node of each trainer slot.
    pub trainer_nodes: Vec<u32>,
}

/// A plan that does not fit its job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RelayError {
    #[error("relayed pushes: the plan places {planned} {what}, the job has {job}")]
    Count {
        what: &'static str,
        planned: usize,
        job: usize,
    },
    #[error("relayed pushes: a node of 0 devices")]
    EmptyNode,
}

impl RelayPlan {
    /// `trainers` devices in nodes of `node_size`, trainer `t` on device `t`, and `servers`
    /// servers spread evenly over the devices (server `s` on device `s · ⌈trainers/servers⌉`, as
    /// the benchmark's modelled cluster places them).
    ///
    /// ```
    /// use odc_policy::relay::RelayPlan;
    /// let plan = RelayPlan::even(16, 2, 8).unwrap();
    /// assert_eq!(plan.server_nodes, vec![0, 1]);
    /// assert_eq!(plan.relay(0, 1), Some(0), "node 0 relays server 1's shards on server 0");
    /// assert_eq!(plan.relay(0, 0), None, "server 0 is on node 0");
    /// ```
    pub fn even(trainers: u32, servers: u32, node_size: u32) -> Result<Self, RelayError> {
        if node_size == 0 {
            return Err(RelayError::EmptyNode);
        }
        let per_server = trainers.max(1).div_ceil(servers.max(1));
        Ok(RelayPlan {
            server_nodes: (0..servers)
                .map(|s| s.saturating_mul(per_server) / node_size)
                .collect(),
            trainer_nodes: (0..trainers).map(|t| t / node_size).collect(),
        })
    }

    /// The plan fits a job of `trainers` and `servers`.
    pub fn check(&self, trainers: u32, servers: u32) -> Result<(), RelayError> {
        let fits = |what, planned: usize, job: u32| {
            if planned == job as usize {
                Ok(())
            } else {
                Err(RelayError::Count {
                    what,
                    planned,
                    job: job as usize,
                })
            }
        };
        fits("trainers", self.trainer_nodes.len(), trainers)?;
        fits("shard servers", self.server_nodes.len(), servers)
    }

    /// The node of trainer `slot` (`None`: outside the plan).
    pub fn trainer_node(&self, slot: u32) -> Option<u32> {
        self.trainer_nodes.get(slot as usize).copied()
    }

    /// The servers on `node`, in endpoint order.
    fn servers_on(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        (0u32..)
            .zip(&self.server_nodes)
            .filter(move |(_, n)| **n == node)
            .map(|(s, _)| s)
    }

    /// The server of `node` that takes `node`'s pushes for owner `owner`'s shards: `None` when
    /// the owner is on `node` (or unknown), or `node` has no server.
    pub fn relay(&self, node: u32, owner: u32) -> Option<u32> {
        let owner_node = *self.server_nodes.get(owner as usize)?;
        if owner_node == node {
            return None;
        }
        let position = self.servers_on(owner_node).position(|s| s == owner)?;
        let here: Vec<u32> = self.servers_on(node).collect();
        here.get(position % here.len().max(1)).copied()
    }

    /// The owners whose shards `server` relays for its node, in endpoint order.
    pub fn relays_of(&self, server: u32) -> Vec<u32> {
        let Some(&node) = self.server_nodes.get(server as usize) else {
            return Vec::new();
        };
        (0..self.server_nodes.len() as u32)
            .filter(|&owner| self.relay(node, owner) == Some(server))
            .collect()
    }

    /// The relay micro-batch number of server `server`'s flushes.
    pub fn flush_micro_batch(server: u32) -> u32 {
        RELAY_MICRO_BATCH_BASE | (server & !RELAY_MICRO_BATCH_BASE)
    }
}

/// What one relay combined in the attempt it flushed: the micro-batches whose writes it applied
/// (from their write ids), ascending. A flush reports every relay of its server, also one that
/// took nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Combined {
    /// The relay's shard server (its endpoint).
    pub server: u32,
    pub unit: u32,
    /// The owner it flushed into.
    pub owner: u32,
    pub micro_batches: Vec<u32>,
    /// It flushed before the barrier, as soon as its node's writes were in.
    #[serde(default)]
    pub early: bool,
}

/// A flush whose count disagrees with the ledger: a gradient lost, counted twice or relayed by the
/// wrong node. Names the relay and the micro-batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlushMismatch {
    #[error(
        "the relay of unit {unit} for owner {owner} on server {server} combined micro-batch \
         {micro_batch}, which the ledger does not count as done"
    )]
    NotDone {
        server: u32,
        unit: u32,
        owner: u32,
        micro_batch: u32,
    },
    #[error(
        "the relay of unit {unit} for owner {owner} on server {server} (node {node}) combined \
         micro-batch {micro_batch}, which trainer {trainer} of node {trainer_node} did"
    )]
    OtherNode {
        server: u32,
        unit: u32,
        owner: u32,
        micro_batch: u32,
        node: u32,
        trainer: u32,
        trainer_node: u32,
    },
    #[error(
        "the relay of unit {unit} for owner {owner} on server {server} misses micro-batch \
         {micro_batch}, which trainer {trainer} of its node did"
    )]
    Missing {
        server: u32,
        unit: u32,
        owner: u32,
        micro_batch: u32,
        trainer: u32,
    },
    #[error("server {server} flushed a relay for owner {owner}, which the plan does not give it")]
    NotARelay { server: u32, owner: u32 },
    #[error(
        "the relay of unit {unit} for owner {owner} on server {server} reported micro-batches \
         that are not strictly ascending"
    )]
    Unordered { server: u32, unit: u32, owner: u32 },
}

impl RelayPlan {
    /// Check what the relays combined against the ledger (module docs): `done_by` gives the
    /// trainer that completed each of the attempt's `micro_batches` (`None`: not done). With
    /// `every_micro_batch_pushes` (on demand: each micro-batch pushes every shard of every unit)
    /// a relay must hold exactly its node's micro-batches; otherwise (collective mode: a
    /// trainer pushes only the pieces it reduced) only a subset of them. The first disagreement
    /// is the error.
    pub fn check_combined(
        &self,
        micro_batches: u32,
        done_by: impl Fn(u32) -> Option<u32>,
        combined: &[Combined],
        every_micro_batch_pushes: bool,
    ) -> Result<(), FlushMismatch> {
        // Each node's done micro-batches, ascending, with their trainers: once, not per relay.
        let mut by_node: HashMap<u32, Vec<(u32, u32)>> = HashMap::new();
        for micro_batch in 0..micro_batches {
            if let Some(trainer) = done_by(micro_batch) {
                if let Some(node) = self.trainer_node(trainer) {
                    by_node
                        .entry(node)
                        .or_default()
                        .push((micro_batch, trainer));
                }
            }
        }
        // Whether `server` relays for `owner`: once per pair, not per unit.
        let mut relays: HashMap<(u32, u32), bool> = HashMap::new();
        for relay in combined {
            let (server, unit, owner) = (relay.server, relay.unit, relay.owner);
            let node = self.server_nodes.get(server as usize).copied();
            let valid = *relays.entry((server, owner)).or_insert_with(|| {
                node.is_some_and(|node| self.relay(node, owner) == Some(server))
            });
            let Some(node) = node.filter(|_| valid) else {
                return Err(FlushMismatch::NotARelay { server, owner });
            };
            if relay.micro_batches.windows(2).any(|w| w[0] >= w[1]) {
                return Err(FlushMismatch::Unordered {
                    server,
                    unit,
                    owner,
                });
            }
            for &micro_batch in &relay.micro_batches {
                let Some(trainer) = done_by(micro_batch) else {
                    return Err(FlushMismatch::NotDone {
                        server,
                        unit,
                        owner,
                        micro_batch,
                    });
                };
                let trainer_node = self.trainer_node(trainer);
                if trainer_node != Some(node) {
                    return Err(FlushMismatch::OtherNode {
                        server,
                        unit,
                        owner,
                        micro_batch,
                        node,
                        trainer,
                        trainer_node: trainer_node.unwrap_or(u32::MAX),
                    });
                }
            }
            // Distinct and all the node's (above): complete exactly when as many.
            let node_done = by_node.get(&node).map_or(&[][..], Vec::as_slice);
            if every_micro_batch_pushes && relay.micro_batches.len() != node_done.len() {
                let missing = node_done
                    .iter()
                    .find(|(mb, _)| relay.micro_batches.binary_search(mb).is_err());
                if let Some(&(micro_batch, trainer)) = missing {
                    return Err(FlushMismatch::Missing {
                        server,
                        unit,
                        owner,
                        micro_batch,
                        trainer,
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_relay_per_node_and_off_node_owner_on_the_owners_rail() {
        // 4 nodes of 2 servers each.
        let plan = RelayPlan {
            server_nodes: vec![0, 0, 1, 1, 2, 2, 3, 3],
            trainer_nodes: vec![0; 8],
        };
        for node in 0..4 {
            for owner in 0..8u32 {
                let relay = plan.relay(node, owner);
                if owner / 2 == node {
                    assert_eq!(relay, None, "owner {owner} is on node {node}");
                } else {
                    // Same position within its node: the rail.
                    assert_eq!(
                        relay,
                        Some(node * 2 + owner % 2),
                        "node {node} owner {owner}"
                    );
                }
            }
        }
        assert_eq!(plan.relays_of(0), vec![2, 4, 6]);
        assert_eq!(plan.relays_of(3), vec![1, 5, 7]);
        for server in 0..8 {
            for owner in plan.relays_of(server) {
                assert_eq!(
                    plan.relay(plan.server_nodes[server as usize], owner),
                    Some(server)
                );
            }
        }
    }

    #[test]
    fn uneven_nodes_fold_positions_and_a_node_without_servers_relays_nothing() {
        let plan = RelayPlan {
            server_nodes: vec![0, 1, 1, 1],
            trainer_nodes: vec![0, 1, 2],
        };
        // Node 0 has one server: it relays every owner of node 1.
        assert_eq!(plan.relays_of(0), vec![1, 2, 3]);
        assert_eq!(plan.relay(1, 0), Some(1));
        assert_eq!(plan.relay(2, 1), None, "node 2 has no server");
        assert_eq!(plan.relay(0, 9), None, "no such owner");
        assert_eq!(plan.trainer_node(2), Some(2));
        assert_eq!(plan.trainer_node(3), None);
    }

    #[test]
    fn even_plans_place_servers_as_the_modelled_cluster_and_are_checked() {
        let plan = RelayPlan::even(64, 8, 8).unwrap();
        assert_eq!(plan.server_nodes, (0..8).collect::<Vec<_>>());
        assert_eq!(plan.trainer_nodes[9], 1);
        assert!(plan.check(64, 8).is_ok());
        assert!(matches!(
            plan.check(63, 8),
            Err(RelayError::Count {
                what: "trainers",
                ..
            })
        ));
        // One server per device.
        let fine = RelayPlan::even(16, 16, 8).unwrap();
        assert_eq!(fine.relay(1, 3), Some(11));
        assert_eq!(RelayPlan::even(4, 1, 0), Err(RelayError::EmptyNode));
        assert_eq!(RelayPlan::flush_micro_batch(5), RELAY_MICRO_BATCH_BASE + 5);
    }

    /// Two nodes of two trainers, one server each; micro-batches 0–3 done by trainers 0–3.
    fn two_nodes() -> (RelayPlan, impl Fn(u32) -> Option<u32>) {
        let plan = RelayPlan {
            server_nodes: vec![0, 1],
            trainer_nodes: vec![0, 0, 1, 1],
        };
        (plan, |mb: u32| (mb < 4).then_some(mb))
    }

    fn combined(server: u32, owner: u32, micro_batches: &[u32]) -> Combined {
        Combined {
            server,
            unit: 7,
            owner,
            micro_batches: micro_batches.to_vec(),
            early: false,
        }
    }

    #[test]
    fn a_flush_that_combined_exactly_its_nodes_micro_batches_passes() {
        let (plan, done_by) = two_nodes();
        let flushed = [combined(0, 1, &[0, 1]), combined(1, 0, &[2, 3])];
        assert_eq!(plan.check_combined(4, &done_by, &flushed, true), Ok(()));
        // Collective mode: a subset is what a trainer's reduced pieces give.
        let partial = [combined(0, 1, &[1]), combined(1, 0, &[])];
        assert_eq!(plan.check_combined(4, &done_by, &partial, false), Ok(()));
    }

    #[test]
    fn a_lost_doubled_or_misplaced_micro_batch_fails_the_check_naming_it() {
        let (plan, done_by) = two_nodes();
        let check = |flushed: &[Combined], all| plan.check_combined(4, &done_by, flushed, all);
        // Lost: node 0's relay misses micro-batch 1 (on demand every micro-batch pushes).
        assert_eq!(
            check(&[combined(0, 1, &[0])], true),
            Err(FlushMismatch::Missing {
                server: 0,
                unit: 7,
                owner: 1,
                micro_batch: 1,
                trainer: 1
            })
        );
        // Relayed by the wrong node: micro-batch 2 was trainer 2's, on node 1 (its gradient
        // would reach owner 1 twice).
        assert!(matches!(
            check(&[combined(0, 1, &[0, 1, 2])], false),
            Err(FlushMismatch::OtherNode {
                micro_batch: 2,
                trainer: 2,
                trainer_node: 1,
                node: 0,
                ..
            })
        ));
        // Not in the ledger at all (another attempt's, or never run).
        assert!(matches!(
            check(&[combined(1, 0, &[2, 3, 9])], false),
            Err(FlushMismatch::NotDone { micro_batch: 9, .. })
        ));
        // A relay the plan does not have: server 0 relaying its own node's owner.
        assert_eq!(
            check(&[combined(0, 0, &[])], false),
            Err(FlushMismatch::NotARelay {
                server: 0,
                owner: 0
            })
        );
        assert!(check(&[combined(5, 0, &[])], false).is_err(), "no server 5");
        // A repeated micro-batch would pass for the missing one by count alone.
        assert!(matches!(
            check(&[combined(0, 1, &[0, 0])], true),
            Err(FlushMismatch::Unordered { server: 0, .. })
        ));
        let text = check(&[combined(0, 1, &[0])], true)
            .unwrap_err()
            .to_string();
        assert!(text.contains("misses micro-batch 1"), "{text}");
    }
}
