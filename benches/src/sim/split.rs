//! Long-sequence splitting: a planning policy that cuts the sequences one device cannot finish in
//! the balanced step across several devices (context parallelism), packs the rest whole, and
//! balances both with the same cost model ([`super::profile`]).
//!
//! # Policy
//!
//! 1. **Costs.** A whole sample of `s` tokens costs `w(s) = fixed + sample_s(s)` (one micro-batch of
//!    its own, [`DeviceProfile::micro_batch_s`]). The **balanced step** (the target) is the perfect
//!    balance bound: `(Σ sample_s(s_i) + fixed·⌈Σ s_i / budget⌉) / D` — every sample's marginal cost
//!    plus the fewest micro-batches' fixed costs, spread evenly.
//! 2. **Split.** A sample with `w(s) > target` is considered for `k` devices, `k ∈ {2, …, G}` (one
//!    node, `G` GPUs per node) then `{2G, 3G, …}` (whole nodes), up to `D`. The smallest `k` whose
//!    per-rank time fits the target is taken; if none fits, the `k` with the smallest per-rank time.
//!    If that time is not below `w(s)` (communication eats the gain), the sample stays whole.
//! 3. **Balance.** Split groups first, costliest first: a group takes `k` devices at once (its ranks
//!    run the sequence's layers together) — inside one node the `k` least-loaded devices of the node
//!    where they are free earliest, across nodes the `k / G` whole nodes free earliest — and starts
//!    when the last of them is free. Then whole samples, costliest first, each onto the least-loaded
//!    device (LPT, ties by device index); a device packs its samples next-fit into micro-batches of
//!    at most `budget` tokens, each micro-batch paying the fixed cost once.
//! 4. **Step** = the latest device's finish. Splitting the costliest `j` of the samples worth
//!    splitting is tried for `j ∈ {0, 1, 2, 4, …, all}` and the shortest step is kept (ties: fewer
//!    splits): when most samples exceed the target (about one sample per device), gangs crowd each
//!    other and splitting all of them can lose to splitting a few. `j = 0` is the unsplit plan, so
//!    the planned step with splitting is never longer than without.
//!
//! # Context-parallel cost model (one sample, `k` ranks)
//!
//! - Causal sequence cut into `2k` chunks, chunks `i` and `2k − i − 1` on rank `i` (Zeppelin): each
//!   rank holds `s/k` tokens and `1/k` of the triangular attention. Per-rank compute:
//!   `max(sample_s(s)/k, sample_s(s/k)) + fixed` — the `k`-th of the sequence, but never cheaper than
//!   a sample of `s/k` tokens (small chunks lose kernel efficiency as small samples do).
//! - **Attention communication: ring** (K/V blocks passed around the `k` ranks, each step
//!   overlapped with the attention of the block in hand), not all-to-all: all-to-all (Ulysses)
//!   splits heads and the Qwen2.5 layers have 4 (7B) or 2 (1.5B) key/value heads, which caps it at
//!   `k ≤ 4`; the ring works for any `k` and hides behind compute when attention outgrows
//!   communication — the criterion by which Zeppelin classes sequences local / intra-node /
//!   inter-node. Per block layer: forward `k − 1` steps, each sending `(s/k)·kv_bytes_per_token`
//!   bytes to the next rank (`latency + bytes/bandwidth`), against `attn(s) / (3k²)` of forward
//!   attention per step (`attn` = the block's marginal cost times its attention share); backward
//!   moves K/V and dK/dV (twice the bytes) against twice the compute. Exposed communication per
//!   layer: `3(k − 1)·max(0, step_comm − attn(s)/(3k²))`.
//! - Links: NVLink and the intra-node ring step latency when `k ≤ G`, else the NIC and the
//!   inter-node latency (a ring over nodes is bound by its cross-node hop).
//! - Not modelled: the linear layers' remapping (Zeppelin's remapping layer: the token-balanced
//!   layout is what the `2k`-chunk cut already gives), parameter pulls and gradient pushes (the same
//!   per micro-batch whether a micro-batch is a piece or a whole sample; the projection prices
//!   them), and the load imbalance of an uneven zig-zag when `s` is not a multiple of `2k`.
//!
//! # Guarantees
//!
//! Deterministic (ties by index); every sample is placed exactly once, whole on one device or as
//! one piece on each of `k` distinct devices; with splitting off, or when no sample exceeds the
//! target, the plan is the unsplit plan. `step ≥ perfect` always holds for the unsplit plan.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::profile::DeviceProfile;
use super::topology::{Topology, TopologyError};

/// ODC's default micro-batch token budget.
pub const DEFAULT_TOKEN_BUDGET: u64 = 65_536;

/// What was wrong with a planning request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SplitError {
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A token budget of zero.
    #[error("the micro-batch token budget must be positive")]
    NoBudget,
}

/// Planning options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitOptions {
    /// Tokens per micro-batch of whole samples.
    pub token_budget: u64,
    /// Whether long sequences may be split.
    pub split: bool,
}

impl Default for SplitOptions {
    fn default() -> Self {
        SplitOptions {
            token_budget: DEFAULT_TOKEN_BUDGET,
            split: true,
        }
    }
}

/// Per-rank cost of one sample split over `k` devices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpCost {
    pub k: u32,
    /// Whether the ranks span nodes (ring over the NIC).
    pub inter_node: bool,
    /// Per-rank compute, seconds (fixed cost included).
    pub compute_s: f64,
    /// Ring-attention communication not hidden behind attention, seconds.
    pub comm_exposed_s: f64,
}

impl CpCost {
    /// Seconds each rank is busy.
    pub fn piece_s(&self) -> f64 {
        self.compute_s + self.comm_exposed_s
    }
}

/// The context-parallel cost of `tokens` over `k ≥ 2` ranks (see the module docs).
pub fn context_parallel_cost(
    profile: &DeviceProfile,
    topology: &Topology,
    tokens: u64,
    k: u32,
) -> CpCost {
    let kf = f64::from(k.max(1));
    let chunk = tokens.div_ceil(u64::from(k.max(1)));
    let compute_s =
        (profile.sample_s(tokens) / kf).max(profile.sample_s(chunk)) + profile.fixed_s();
    let inter_node = k > topology.gpus_per_node;
    let (link, step_latency) = if inter_node {
        (topology.nic, topology.ring_step_inter_s)
    } else {
        (topology.nvlink, topology.ring_step_intra_s)
    };
    let block = profile.block();
    let attn = block.marginal_s(tokens) * block.attention_fraction(tokens);
    let step_comm = step_latency + link.serialize_s(chunk * profile.kv_bytes_per_token);
    let per_layer = 3.0 * (kf - 1.0) * (step_comm - attn / (3.0 * kf * kf)).max(0.0);
    CpCost {
        k,
        inter_node,
        compute_s,
        comm_exposed_s: f64::from(block.count) * per_layer,
    }
}

/// One split sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitGroup {
    pub sample: usize,
    pub tokens: u64,
    pub cost: CpCost,
    /// The devices of ranks `0..k`, ascending.
    pub devices: Vec<u32>,
    pub start_s: f64,
}

/// What one device runs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceAssignment {
    /// Indices into [`SplitPlan::groups`] of the pieces it runs.
    pub pieces: Vec<usize>,
    /// Whole samples (indices into the lengths) per micro-batch.
    pub micro_batches: Vec<Vec<usize>>,
    /// When it finishes, seconds (idle time before a group's start included).
    pub finish_s: f64,
}

/// A planned step.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPlan {
    pub devices: Vec<DeviceAssignment>,
    pub groups: Vec<SplitGroup>,
    /// Modelled step time: the latest device's finish.
    pub step_s: f64,
    /// Perfect balance: total cost / D (the target).
    pub perfect_s: f64,
    /// Best possible without splitting: `max(perfect, costliest whole sample)`.
    pub achievable_unsplit_s: f64,
}

/// Candidate split widths for `d` devices in nodes of `g`.
fn widths(d: u32, g: u32) -> impl Iterator<Item = u32> {
    (2..=g.min(d)).chain((2..=d / g).map(move |n| n * g))
}

/// The split for one sample of whole cost `whole_s` (see the module docs); `None`: keep it whole.
fn choose(
    profile: &DeviceProfile,
    topology: &Topology,
    d: u32,
    tokens: u64,
    whole_s: f64,
    target_s: f64,
) -> Option<CpCost> {
    let mut best: Option<CpCost> = None;
    for k in widths(d, topology.gpus_per_node) {
        let c = context_parallel_cost(profile, topology, tokens, k);
        if c.piece_s() <= target_s {
            best = Some(c);
            break;
        }
        if best.is_none_or(|b| c.piece_s() < b.piece_s()) {
            best = Some(c);
        }
    }
    best.filter(|b| b.piece_s() < whole_s)
}

/// Plans one step of `lengths` over the devices of `topology` (see the module docs).
pub fn plan(
    lengths: &[u64],
    profile: &DeviceProfile,
    topology: &Topology,
    options: SplitOptions,
) -> Result<SplitPlan, SplitError> {
    topology.validate()?;
    if options.token_budget == 0 {
        return Err(SplitError::NoBudget);
    }
    let d = topology.devices();
    let fixed = profile.fixed_s();
    let marginal: Vec<f64> = lengths.iter().map(|&s| profile.sample_s(s)).collect();
    let tokens: u64 = lengths.iter().sum();
    let fewest = tokens.div_ceil(options.token_budget);
    let perfect_s = (marginal.iter().sum::<f64>() + fixed * fewest as f64) / f64::from(d);
    let whole = |i: usize| fixed + marginal[i];
    let achievable_unsplit_s = (0..lengths.len()).map(whole).fold(perfect_s, f64::max);

    // Costliest first, ties by index.
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&x, &y| marginal[y].total_cmp(&marginal[x]).then(x.cmp(&y)));

    // The samples worth splitting, costliest first, with their split.
    let candidates: Vec<(usize, CpCost)> = order
        .iter()
        .filter(|&&i| options.split && whole(i) > perfect_s)
        .filter_map(|&i| {
            choose(profile, topology, d, lengths[i], whole(i), perfect_s).map(|c| (i, c))
        })
        .collect();
    // Split the costliest j of them, j ∈ {0, 1, 2, 4, …, all}; keep the shortest step (ties: fewer
    // splits). j = 0 is the unsplit plan, so splitting never makes the step longer.
    let mut best: Option<(f64, Vec<DeviceAssignment>, Vec<SplitGroup>)> = None;
    let mut j = 0usize;
    loop {
        let (devices, groups) = place(
            lengths,
            &order,
            &candidates[..j],
            &marginal,
            fixed,
            topology,
            options,
        );
        let step = devices.iter().map(|a| a.finish_s).fold(0.0f64, f64::max);
        if best.as_ref().is_none_or(|b| step < b.0) {
            best = Some((step, devices, groups));
        }
        if j == candidates.len() {
            break;
        }
        j = (2 * j).clamp(1, candidates.len());
    }
    let (step_s, devices, groups) = best.unwrap_or_default();
    Ok(SplitPlan {
        devices,
        groups,
        step_s,
        perfect_s,
        achievable_unsplit_s,
    })
}

/// Places `splits` as gangs, then every other sample of `order` whole (see the module docs).
fn place(
    lengths: &[u64],
    order: &[usize],
    splits: &[(usize, CpCost)],
    marginal: &[f64],
    fixed: f64,
    topology: &Topology,
    options: SplitOptions,
) -> (Vec<DeviceAssignment>, Vec<SplitGroup>) {
    let d = topology.devices();
    let g = topology.gpus_per_node;
    let mut is_split = vec![false; lengths.len()];
    let mut groups: Vec<SplitGroup> = splits
        .iter()
        .map(|&(i, cost)| {
            is_split[i] = true;
            SplitGroup {
                sample: i,
                tokens: lengths[i],
                cost,
                devices: Vec::new(),
                start_s: 0.0,
            }
        })
        .collect();
    let rest: Vec<usize> = order.iter().copied().filter(|&i| !is_split[i]).collect();
    groups.sort_by(|x, y| {
        y.cost
            .piece_s()
            .total_cmp(&x.cost.piece_s())
            .then(x.sample.cmp(&y.sample))
    });

    let mut devices = vec![DeviceAssignment::default(); d as usize];
    let node_devices = |node: u32| (node * g)..((node + 1) * g).min(d);
    for (gi, group) in groups.iter_mut().enumerate() {
        let k = group.cost.k;
        let chosen: Vec<u32> = if k <= g {
            // The node where its k least-loaded devices are free earliest.
            let mut best: Option<(f64, Vec<u32>)> = None;
            for node in 0..topology.nodes {
                let mut ds: Vec<u32> = node_devices(node).collect();
                if ds.len() < k as usize {
                    continue;
                }
                ds.sort_by(|&x, &y| {
                    devices[x as usize]
                        .finish_s
                        .total_cmp(&devices[y as usize].finish_s)
                        .then(x.cmp(&y))
                });
                ds.truncate(k as usize);
                let start = devices[ds[k as usize - 1] as usize].finish_s;
                if best.as_ref().is_none_or(|b| start < b.0) {
                    best = Some((start, ds));
                }
            }
            best.map(|b| b.1).unwrap_or_default()
        } else {
            // The k / G whole nodes free earliest.
            let free = |node: u32| {
                node_devices(node)
                    .map(|x| devices[x as usize].finish_s)
                    .fold(0.0f64, f64::max)
            };
            let mut nodes: Vec<u32> = (0..topology.nodes)
                .filter(|&n| node_devices(n).len() == g as usize)
                .collect();
            nodes.sort_by(|&x, &y| free(x).total_cmp(&free(y)).then(x.cmp(&y)));
            nodes.truncate((k / g) as usize);
            nodes.into_iter().flat_map(node_devices).collect()
        };
        let mut chosen = chosen;
        chosen.sort_unstable();
        let start = chosen
            .iter()
            .map(|&x| devices[x as usize].finish_s)
            .fold(0.0f64, f64::max);
        for &x in &chosen {
            devices[x as usize].finish_s = start + group.cost.piece_s();
            devices[x as usize].pieces.push(gi);
        }
        group.devices = chosen;
        group.start_s = start;
    }

    // Whole samples: LPT, next-fit packing per device.
    let mut open_tokens = vec![0u64; d as usize];
    let mut heap: BinaryHeap<Reverse<(Seconds, u32)>> = devices
        .iter()
        .enumerate()
        .map(|(x, a)| Reverse((Seconds(a.finish_s), x as u32)))
        .collect();
    for i in rest {
        let Some(Reverse((_, x))) = heap.pop() else {
            break;
        };
        let dev = &mut devices[x as usize];
        let fits = dev.micro_batches.last().is_some()
            && open_tokens[x as usize] + lengths[i] <= options.token_budget;
        if fits {
            if let Some(mb) = dev.micro_batches.last_mut() {
                mb.push(i);
            }
            open_tokens[x as usize] += lengths[i];
        } else {
            dev.micro_batches.push(vec![i]);
            open_tokens[x as usize] = lengths[i];
            dev.finish_s += fixed;
        }
        dev.finish_s += marginal[i];
        heap.push(Reverse((Seconds(dev.finish_s), x)));
    }
    (devices, groups)
}

/// A totally ordered load for the LPT heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seconds(f64);

impl Eq for Seconds {}

impl PartialOrd for Seconds {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Seconds {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::profile::ModelShape;
    use crate::workload::Workload;

    fn seven_b() -> DeviceProfile {
        DeviceProfile::builtin(ModelShape::B7, 28).unwrap()
    }

    /// Every sample placed exactly once: whole on one device or as k pieces on k devices.
    fn assert_exactly_once(plan: &SplitPlan, n: usize) {
        let mut seen = vec![0usize; n];
        for a in &plan.devices {
            for mb in &a.micro_batches {
                assert!(!mb.is_empty());
                for &i in mb {
                    seen[i] += 1;
                }
            }
        }
        for g in &plan.groups {
            assert_eq!(g.devices.len(), g.cost.k as usize);
            let mut ds = g.devices.clone();
            ds.dedup();
            assert_eq!(ds.len(), g.devices.len(), "distinct devices");
            seen[g.sample] += 1;
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
    }

    #[test]
    fn splitting_one_huge_sequence_reaches_near_perfect_balance() {
        let profile = seven_b();
        let topo = Topology::h100_devices(64).unwrap();
        let mut lengths = vec![65_536];
        lengths.extend(std::iter::repeat_n(4096, 1023));
        let unsplit = plan(
            &lengths,
            &profile,
            &topo,
            SplitOptions {
                split: false,
                ..SplitOptions::default()
            },
        )
        .unwrap();
        let split = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
        assert_exactly_once(&unsplit, lengths.len());
        assert_exactly_once(&split, lengths.len());
        assert!(unsplit.groups.is_empty());
        assert_eq!(split.groups.len(), 1);
        assert_eq!(split.groups[0].sample, 0);
        // Without splitting the 64K sample sets the step: the achievable bound.
        assert!((unsplit.step_s - unsplit.achievable_unsplit_s).abs() < 1e-9);
        assert!(unsplit.step_s > 2.0 * unsplit.perfect_s, "{unsplit:?}");
        // With it, within 10% of perfect balance (a 4K sample is 6% of the balanced step).
        let ratio = split.step_s / split.perfect_s;
        assert!(ratio.is_finite() && (1.0..1.10).contains(&ratio), "{ratio}");
    }

    #[test]
    fn a_balanced_workload_splits_nothing_and_plans_as_unsplit() {
        let profile = seven_b();
        let topo = Topology::h100_devices(16).unwrap();
        let lengths = Workload::Balanced { tokens: 16_384 }.sample(64, 0);
        let with = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
        let without = plan(
            &lengths,
            &profile,
            &topo,
            SplitOptions {
                split: false,
                ..SplitOptions::default()
            },
        )
        .unwrap();
        assert!(with.groups.is_empty());
        assert_eq!(with, without);
        assert!(
            (with.step_s / with.perfect_s - 1.0).abs() < 1e-9,
            "{with:?}"
        );
        assert_exactly_once(&with, lengths.len());
    }

    #[test]
    fn a_slow_link_makes_splitting_lose_for_mid_length_sequences() {
        let profile = seven_b();
        let fast = Topology::h100_devices(8).unwrap();
        let mut slow = fast.clone();
        slow.nvlink.bytes_per_s = 1e9;
        let whole = profile.micro_batch_s(&[32_768]);
        for k in 2..=8 {
            let f = context_parallel_cost(&profile, &fast, 32_768, k);
            let s = context_parallel_cost(&profile, &slow, 32_768, k);
            assert_eq!(f.compute_s, s.compute_s);
            assert!(f.piece_s() < whole, "fast k={k}: {f:?}");
            assert!(s.piece_s() > whole, "slow k={k}: {s:?} vs {whole}");
            assert!(s.comm_exposed_s > f.comm_exposed_s);
        }
        let mut lengths = vec![32_768];
        lengths.extend(std::iter::repeat_n(4096, 8));
        let on_fast = plan(&lengths, &profile, &fast, SplitOptions::default()).unwrap();
        let on_slow = plan(&lengths, &profile, &slow, SplitOptions::default()).unwrap();
        assert_eq!(on_fast.groups.len(), 1);
        assert!(on_fast.step_s < on_slow.step_s);
        assert!(on_slow.groups.is_empty(), "{:?}", on_slow.groups);
        assert!((on_slow.step_s - on_slow.achievable_unsplit_s).abs() < 1e-9);
    }

    #[test]
    fn ring_attention_hides_behind_compute_for_long_sequences_on_nvlink() {
        let profile = seven_b();
        let topo = Topology::h100_devices(64).unwrap();
        let inside = context_parallel_cost(&profile, &topo, 65_536, 8);
        assert!(!inside.inter_node);
        assert_eq!(inside.comm_exposed_s, 0.0);
        // Across nodes, short chunks: the NIC shows.
        let across = context_parallel_cost(&profile, &topo, 16_384, 64);
        assert!(across.inter_node);
        assert!(across.comm_exposed_s > 0.0, "{across:?}");
        // Never cheaper per rank than a sample of the chunk's length.
        assert!(across.compute_s >= profile.micro_batch_s(&[256]) - 1e-12);
    }

    #[test]
    fn plans_are_deterministic_and_bounds_hold() {
        let profile = seven_b();
        for d in [8, 64] {
            let topo = Topology::h100_devices(d).unwrap();
            let lengths = Workload::SweSmith.sample(4 * d as usize, 7);
            let a = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
            let b = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
            assert_eq!(a, b);
            assert_exactly_once(&a, lengths.len());
            assert!(a.step_s >= a.perfect_s - 1e-9);
            assert!(a.achievable_unsplit_s >= a.perfect_s);
        }
        let topo = Topology::h100_devices(8).unwrap();
        let err = plan(
            &[1],
            &profile,
            &topo,
            SplitOptions {
                token_budget: 0,
                split: true,
            },
        )
        .unwrap_err();
        assert_eq!(err, SplitError::NoBudget);
        let empty = plan(&[], &profile, &topo, SplitOptions::default()).unwrap();
        assert_eq!((empty.step_s, empty.perfect_s), (0.0, 0.0));
    }
}
