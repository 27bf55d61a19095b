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
//!    If that time is not below `max(w(s), pull)` (the whole sample's micro-batch, see *Parameter
//!    pulls*: communication or pulls eat the gain), the sample stays whole.
//! 3. **Balance.** Split groups first, costliest first: a group takes `k` devices at once (its ranks
//!    run the sequence's layers together) — inside one node the `k` least-loaded devices of the node
//!    where they are free earliest, across nodes the `k / G` whole nodes free earliest — and starts
//!    when the last of them is free. Then whole samples, costliest first, each onto the least-loaded
//!    device (LPT, ties by device index); a device packs its samples next-fit into micro-batches of
//!    at most `budget` tokens, each micro-batch paying the fixed cost once and lasting
//!    `max(compute, pull)`.
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
//!   layout is what the `2k`-chunk cut already gives), gradient pushes (the egress direction of the
//!   same ports; at bf16 gradients half the pull bytes), the pulls' and the ring's share of one
//!   NIC ingress when both cross nodes, and the load imbalance of an uneven zig-zag when `s` is not a
//!   multiple of `2k`.
//!
//! # Parameter pulls (ODC on demand)
//!
//! Every micro-batch pulls the parameters of every block it computes: a whole sample's micro-batch
//! once, a sample split `k` ways on each of its `k` devices (each rank computes every layer on its
//! chunk), so splitting multiplies the pulls by `k`.
//!
//! - **Bytes.** A micro-batch gathers each block twice (forward, and again in backward order; the
//!   last block of the forward pass is served from memory, as the trainer does): `(2L − 1)` gathers
//!   of [`DeviceProfile::layer_bytes`] at [`PULL_PRECISION`] (bf16, 2 bytes per parameter). Only the
//!   blocks: a profile's embedding and head have no parameter count.
//! - **Links.** No HPZ: a device pulls each owner's `1/D` shard point to point; its own shard is
//!   free, the `G − 1` other shards of its node arrive over its NVLink ingress and the `D − G` of
//!   other nodes over its NIC ingress (400 Gb/s = 50 GB/s), in parallel:
//!   `pull = (2L − 1) · max((D − G)/D · bytes / NIC, (G − 1)/D · bytes / NVLink)` (bandwidth only:
//!   prefetching the next block hides the per-message latency). About 0.45 s for the 7B profile's
//!   28 blocks at 64 devices, 0.05 s inside one node.
//! - **Rule.** Pulls overlap compute (the trainer prefetches the next block while computing this
//!   one) and every block costs the same, so a micro-batch — a piece or a packed micro-batch of whole
//!   samples — occupies its device for `max(compute, pull)`; a piece then adds its exposed ring
//!   communication. The balanced step (perfect balance) stays compute only; the unsplit achievable
//!   bound is `max(perfect, max_i max(w(s_i), pull))`.
//! - **Consequence.** A piece costs at least `pull`, so a sample whose whole micro-batch is
//!   pull-bound (`w(s) ≤ pull`: under about 6K tokens for the 7B profile across nodes) is never
//!   split: its pieces would each wait for the same pull as the whole sample.
//!
//! # Guarantees
//!
//! Deterministic (ties by index); every sample is placed exactly once, whole on one device or as
//! one piece on each of `k` distinct devices; with splitting off, or when no sample exceeds the
//! target, the plan is the unsplit plan. `step ≥ perfect` always holds for the unsplit plan.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use odc::Precision;

use super::profile::DeviceProfile;
use super::topology::{Topology, TopologyError};

/// ODC's default micro-batch token budget.
pub const DEFAULT_TOKEN_BUDGET: u64 = 65_536;

/// Precision of the parameters a micro-batch pulls (ODC's published bf16 copy).
pub const PULL_PRECISION: Precision = Precision::Bf16;

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
    /// Per-rank parameter pulls ([`pull_s`]), seconds.
    pub pull_s: f64,
    /// Ring-attention communication not hidden behind attention, seconds.
    pub comm_exposed_s: f64,
}

impl CpCost {
    /// Seconds each rank is busy: `max(compute, pull) + exposed ring communication`.
    pub fn piece_s(&self) -> f64 {
        self.compute_s.max(self.pull_s) + self.comm_exposed_s
    }
}

/// Seconds one device's ingress ports spend on one micro-batch's parameter pulls (see the module
/// docs): `(2L − 1)` block gathers from every other owner, NIC and NVLink in parallel.
///
/// ```
/// use odc_bench::sim::profile::{DeviceProfile, ModelShape};
/// use odc_bench::sim::split::pull_s;
/// use odc_bench::sim::topology::Topology;
/// let p = DeviceProfile::builtin(ModelShape::B7, 28).unwrap();
/// // 55 gathers of 466.2 MB, 56/64 of it over a 50 GB/s NIC.
/// let t = pull_s(&p, &Topology::h100_devices(64).unwrap());
/// assert!((t - 55.0 * 466.2e6 * 56.0 / 64.0 / 50e9).abs() < 1e-9);
/// ```
pub fn pull_s(profile: &DeviceProfile, topology: &Topology) -> f64 {
    let d = f64::from(topology.devices().max(1));
    let g = f64::from(topology.gpus_per_node.clamp(1, topology.devices().max(1)));
    let gathers = f64::from((2 * profile.layers).saturating_sub(1));
    let bytes = profile.layer_bytes(PULL_PRECISION) as f64;
    let over_nic = (d - g) / d * bytes / topology.nic.bytes_per_s;
    let over_nvlink = (g - 1.0) / d * bytes / topology.nvlink.bytes_per_s;
    gathers * over_nic.max(over_nvlink)
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
        pull_s: pull_s(profile, topology),
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
    /// Best possible without splitting: `max(perfect, costliest whole sample's micro-batch)`, a
    /// micro-batch taking `max(compute, pull)`.
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
    let pull = pull_s(profile, topology);
    let whole = |i: usize| fixed + marginal[i];
    // A sample's micro-batch of its own: compute or its pulls, whichever is longer.
    let whole_mb = |i: usize| whole(i).max(pull);
    let achievable_unsplit_s = (0..lengths.len()).map(whole_mb).fold(perfect_s, f64::max);

    // Costliest first, ties by index.
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&x, &y| marginal[y].total_cmp(&marginal[x]).then(x.cmp(&y)));

    // The samples worth splitting, costliest first, with their split.
    let candidates: Vec<(usize, CpCost)> = order
        .iter()
        .filter(|&&i| options.split && whole(i) > perfect_s)
        .filter_map(|&i| {
            choose(profile, topology, d, lengths[i], whole_mb(i), perfect_s).map(|c| (i, c))
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
            MicroBatchCost { fixed, pull },
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

/// What every micro-batch of whole samples costs besides its samples' marginal compute.
#[derive(Debug, Clone, Copy)]
struct MicroBatchCost {
    /// Fixed compute, seconds.
    fixed: f64,
    /// Parameter pulls, overlapped with the compute ([`pull_s`]), seconds.
    pull: f64,
}

/// Places `splits` as gangs, then every other sample of `order` whole (see the module docs).
fn place(
    lengths: &[u64],
    order: &[usize],
    splits: &[(usize, CpCost)],
    marginal: &[f64],
    micro_batch: MicroBatchCost,
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

    // Whole samples: LPT, next-fit packing per device; the open micro-batch of a device started at
    // `open_start` and has `open_compute` seconds of compute, and ends `max(compute, pull)` later.
    let mut open_tokens = vec![0u64; d as usize];
    let mut open_start = vec![0.0f64; d as usize];
    let mut open_compute = vec![0.0f64; d as usize];
    let mut heap: BinaryHeap<Reverse<(Seconds, u32)>> = devices
        .iter()
        .enumerate()
        .map(|(x, a)| Reverse((Seconds(a.finish_s), x as u32)))
        .collect();
    for i in rest {
        let Some(Reverse((_, x))) = heap.pop() else {
            break;
        };
        let xi = x as usize;
        let dev = &mut devices[xi];
        let fits = dev.micro_batches.last().is_some()
            && open_tokens[xi] + lengths[i] <= options.token_budget;
        if fits {
            if let Some(mb) = dev.micro_batches.last_mut() {
                mb.push(i);
            }
            open_tokens[xi] += lengths[i];
            open_compute[xi] += marginal[i];
        } else {
            dev.micro_batches.push(vec![i]);
            open_tokens[xi] = lengths[i];
            open_start[xi] = dev.finish_s;
            open_compute[xi] = micro_batch.fixed + marginal[i];
        }
        dev.finish_s = open_start[xi] + open_compute[xi].max(micro_batch.pull);
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

    /// The 7B profile with parameter pulls ignored (no parameters to pull).
    fn seven_b_without_pulls() -> DeviceProfile {
        DeviceProfile {
            layer_params: 0,
            ..seven_b()
        }
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
        // Ring attention alone: pulls over the slow link would decide it on their own.
        let profile = seven_b_without_pulls();
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
    fn every_micro_batch_waits_for_its_parameter_pulls() {
        let profile = seven_b();
        let inside = pull_s(&profile, &Topology::h100_devices(8).unwrap());
        let across = pull_s(&profile, &Topology::h100_devices(64).unwrap());
        // 55 block gathers of 466.2 MB: 7/8 of them over NVLink in one node, 56/64 over the NIC.
        assert!(
            (inside - 55.0 * 466.2e6 * 7.0 / 8.0 / 450e9).abs() < 1e-9,
            "{inside}"
        );
        assert!(
            (across - 55.0 * 466.2e6 * 56.0 / 64.0 / 50e9).abs() < 1e-9,
            "{across}"
        );
        assert_eq!(
            pull_s(
                &seven_b_without_pulls(),
                &Topology::h100_devices(64).unwrap()
            ),
            0.0
        );
        // A piece is busy for at least the pulls, whatever its compute.
        let topo = Topology::h100_devices(64).unwrap();
        for k in widths(64, 8) {
            let c = context_parallel_cost(&profile, &topo, 2048, k);
            assert_eq!(c.pull_s, across);
            assert!(
                c.piece_s() >= across && c.compute_s < across,
                "k={k}: {c:?}"
            );
        }
        // A device of short whole samples: one micro-batch, as long as its pulls.
        let lengths = vec![1024; 64];
        let p = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
        assert!((p.step_s - across).abs() < 1e-12, "{p:?}");
        assert!((p.achievable_unsplit_s - across).abs() < 1e-12, "{p:?}");
        assert!(p.perfect_s < across, "perfect balance stays compute only");
    }

    #[test]
    fn a_short_sequence_is_never_split_because_each_piece_pulls_the_parameters() {
        // At 64 devices (NIC pulls, 0.45 s per micro-batch) a 4K sample computes in 0.37 s, over the
        // balanced step of 1K samples: worth splitting on compute alone, not with the pulls.
        let topo = Topology::h100_devices(64).unwrap();
        let mut lengths = vec![4096];
        lengths.extend(std::iter::repeat_n(1024, 63));
        let ignored = plan(
            &lengths,
            &seven_b_without_pulls(),
            &topo,
            SplitOptions::default(),
        )
        .unwrap();
        assert!(
            ignored.groups.iter().any(|g| g.sample == 0),
            "without pulls the 4K sample is split: {:?}",
            ignored.groups
        );
        let profile = seven_b();
        let pull = pull_s(&profile, &topo);
        let whole = profile.micro_batch_s(&[4096]);
        assert!(
            whole > ignored.perfect_s && whole < pull,
            "{whole} vs {pull}"
        );
        for k in widths(64, 8) {
            let c = context_parallel_cost(&profile, &topo, 4096, k);
            assert!(c.piece_s() >= whole.max(pull), "k={k}: {c:?}");
        }
        let with = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
        assert!(with.groups.is_empty(), "{:?}", with.groups);
        assert_exactly_once(&with, lengths.len());
        assert!((with.step_s - pull).abs() < 1e-12, "{with:?}");
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
