//! A split plan as the runtime runs it: its prices and options for a step of `devices` trainers
//! ([`runtime_options`]), each gang's pieces as micro-batches ([`gang_pieces`]), and on demand
//! each trainer's list ([`on_demand_lists`]): its gangs' pieces first, in gang order (the same on
//! every member, so no two gangs wait on each other), then its micro-batches of whole samples.
//! The supervisor's step machine and `odc.balance` both plan through these.
//!
//! Invariants (tested below): every sample of the plan is in exactly one micro-batch of whole
//! samples or, split, in one piece per member whose chunks cover it once; each list names its
//! micro-batches once, pieces first.

use std::ops::Range;

use super::{zigzag, CostModelCosts, Gang, RingPrice, SplitError, SplitOptions, SplitPlan};
use crate::balancer::{CostModel, Plan, PlannedMicroBatch};

/// The runtime's prices and options for a step of `devices` trainers: gangs of at most
/// `max_gang` trainers (0: any), the ring priced as `ring` says, samples of at least `min_tokens`
/// split, every piece within `token_budget`. A gang counts as within one node up to the ring's
/// [`RingPrice::node_size`] trainers, or, where it names none, up to the gang limit.
pub fn runtime_options(
    cost: CostModel,
    devices: u32,
    max_gang: u32,
    ring: Option<RingPrice>,
    token_budget: u64,
    min_tokens: u64,
) -> (CostModelCosts, SplitOptions) {
    let max_gang = match max_gang {
        0 => devices,
        n => n.min(devices),
    }
    .max(1);
    let per_node = match ring.map_or(0, |r| r.node_size) {
        0 => max_gang,
        n => n.min(devices).max(1),
    };
    let costs = CostModelCosts {
        cost,
        devices,
        per_node,
        ring,
    };
    let options = SplitOptions {
        token_budget,
        split: true,
        min_tokens,
        max_gang,
        pieces_within_budget: true,
    };
    (costs, options)
}

/// One member's piece of a split sample: gang `gang` of the plan, member `member`, and its two
/// zig-zag chunks of the sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberPiece {
    pub gang: usize,
    pub member: u32,
    pub chunks: [Range<u64>; 2],
}

/// Each member's piece of `gang` (the plan's gang `g`): its device, its micro-batch (no whole
/// samples, the chunks' tokens, the piece's cost) and the piece, in member order.
pub fn gang_pieces(
    g: usize,
    gang: &Gang,
) -> Result<Vec<(u32, PlannedMicroBatch, MemberPiece)>, SplitError> {
    let cut = zigzag(gang.tokens, gang.cost.k)?;
    Ok(gang
        .devices
        .iter()
        .zip(cut)
        .enumerate()
        .map(|(member, (&device, chunks))| {
            let mb = PlannedMicroBatch {
                samples: Vec::new(),
                tokens: chunks.iter().map(|r| r.end - r.start).sum(),
                cost: gang.cost.piece_s(),
            };
            let piece = MemberPiece {
                gang: g,
                member: member as u32,
                chunks,
            };
            (device, mb, piece)
        })
        .collect())
}

/// The on-demand lists of `split` (planned for `lengths`, whole micro-batches priced by `cost`):
/// the plan, and for each of its micro-batches the piece it is, if it is one.
pub fn on_demand_lists(
    lengths: &[u64],
    cost: &CostModel,
    split: &SplitPlan,
) -> Result<(Plan, Vec<Option<MemberPiece>>), SplitError> {
    let mut plan = Plan {
        micro_batches: Vec::new(),
        per_trainer: vec![Vec::new(); split.devices.len()],
    };
    let mut pieces = Vec::new();
    let mut push = |device: usize, mb: PlannedMicroBatch, piece: Option<MemberPiece>| {
        if let Some(list) = plan.per_trainer.get_mut(device) {
            list.push(plan.micro_batches.len());
            plan.micro_batches.push(mb);
            pieces.push(piece);
        }
    };
    for (g, gang) in split.gangs.iter().enumerate() {
        for (device, mb, piece) in gang_pieces(g, gang)? {
            push(device as usize, mb, Some(piece));
        }
    }
    for (device, assignment) in split.devices.iter().enumerate() {
        for samples in &assignment.micro_batches {
            let compute = samples.iter().map(|&i| cost.cost(lengths[i])).sum();
            let mb = PlannedMicroBatch {
                samples: samples.clone(),
                tokens: samples.iter().map(|&i| lengths[i]).sum(),
                cost: cost.micro_batch(compute),
            };
            push(device, mb, None);
        }
    }
    Ok((plan, pieces))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::plan;

    #[test]
    fn the_lists_hold_every_sample_once_and_each_gangs_pieces_first() {
        let lengths = [60_000, 3_000, 2_000, 2_500, 1_000, 4_000, 500, 3_500];
        let cost = CostModel::default();
        let (costs, options) = runtime_options(cost, 4, 0, None, 65_536, 0);
        let split = plan(&lengths, &costs, options).unwrap();
        assert!(!split.gangs.is_empty(), "the long sample is split");
        let (lists, pieces) = on_demand_lists(&lengths, &cost, &split).unwrap();
        assert_eq!(pieces.len(), lists.micro_batches.len());
        let mut covered = vec![0u64; lengths.len()];
        for (mb, piece) in lists.micro_batches.iter().zip(&pieces) {
            match piece {
                Some(p) => {
                    let gang = &split.gangs[p.gang];
                    covered[gang.sample] += p.chunks.iter().map(|r| r.end - r.start).sum::<u64>();
                    assert!(mb.samples.is_empty());
                }
                None => mb.samples.iter().for_each(|&s| covered[s] += lengths[s]),
            }
        }
        assert_eq!(covered, lengths);
        for list in &lists.per_trainer {
            let first_whole = list.iter().position(|&i| pieces[i].is_none());
            let after = first_whole.map_or(&[][..], |at| &list[at..]);
            assert!(after.iter().all(|&i| pieces[i].is_none()), "pieces first");
        }
        let mut named: Vec<usize> = lists.per_trainer.concat();
        named.sort_unstable();
        assert_eq!(named, (0..lists.micro_batches.len()).collect::<Vec<_>>());
    }

    #[test]
    fn gangs_are_capped_at_max_gang_and_at_the_trainers() {
        let (costs, options) = runtime_options(CostModel::default(), 8, 2, None, 1_000, 5);
        assert_eq!(
            (costs.per_node, options.max_gang, options.min_tokens),
            (2, 2, 5)
        );
        let (costs, _) = runtime_options(CostModel::default(), 3, 0, None, 1_000, 0);
        assert_eq!(costs.per_node, 3);
        let (costs, _) = runtime_options(CostModel::default(), 3, 16, None, 1_000, 0);
        assert_eq!(costs.per_node, 3);
    }

    /// A ring that names its node size prices gangs larger than a node on its inter-node link;
    /// the gang limit stays the job's.
    #[test]
    fn a_rings_node_size_sets_which_gangs_cross_nodes() {
        use crate::split::piece_cost;
        let ring = RingPrice {
            node_size: 8,
            kv_bytes_per_token: 1_000,
            inter: crate::split::Link {
                bytes_per_s: 1e6,
                latency_s: 1e-3,
            },
            ..RingPrice::free()
        };
        let (costs, options) = runtime_options(CostModel::default(), 64, 0, Some(ring), 1 << 20, 0);
        assert_eq!((costs.per_node, options.max_gang), (8, 64));
        assert!(!piece_cost(&costs, 65_536, 8).inter_node);
        let across = piece_cost(&costs, 65_536, 16);
        assert!(
            across.inter_node && across.comm_exposed_s > 0.0,
            "{across:?}"
        );
        let (costs, _) = runtime_options(CostModel::default(), 4, 0, Some(ring), 1 << 20, 0);
        assert_eq!(costs.per_node, 4);
        // Each of a layer's k − 1 steps pays its launches and its merges, per chunk token.
        let stepped = RingPrice {
            step_s: 0.01,
            step_per_token_s: 1e-6,
            ..ring
        };
        let (costs, _) = runtime_options(CostModel::default(), 64, 0, Some(stepped), 1 << 20, 0);
        let inside = piece_cost(&costs, 65_536, 8);
        let want = 7.0 * (0.01 + 8_192.0 * 1e-6);
        assert!((inside.comm_exposed_s - want).abs() < 1e-12, "{inside:?}");
    }
}
