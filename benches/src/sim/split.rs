//! Long-sequence splitting on the modelled cluster: `odc_policy::split`'s planner (the runtime's
//! own, [`plan`]) priced by a device profile and a topology ([`Modelled`]). The planner, the
//! ring-attention cost of a gang and the placement are the policy crate's; this file says only what
//! the modelled cluster charges.
//!
//! # What the modelled cluster charges
//!
//! - **Compute**: [`DeviceProfile::sample_s`] per sample, [`DeviceProfile::fixed_s`] per
//!   micro-batch; a layer's attention is its block's marginal cost times its attention share.
//! - **Ring hops**: NVLink and the intra-node ring step latency inside a node; the NIC and the
//!   inter-node latency as soon as a gang spans nodes (a ring over nodes is bound by its cross-node
//!   hop). `kv_bytes_per_token` per token and layer.
//! - **Ring steps' own cost**: each step's launches and merges on the member's compute stream
//!   ([`super::profile::RingStep`]), not hidden by the hop.
//! - Not modelled: the linear layers' remapping (Zeppelin's remapping layer: the token-balanced
//!   layout is what the `2k`-chunk cut already gives), gradient pushes (the egress direction of the
//!   same ports; at bf16 gradients half the pull bytes), the pulls' and the ring's share of one
//!   NIC ingress when both cross nodes.
//!
//! # Parameter pulls (ODC on demand)
//!
//! Every micro-batch pulls the parameters of every block it computes: a whole sample's micro-batch
//! once, a sample split `k` ways on each of its `k` devices (each member computes every layer on
//! its chunks), so splitting multiplies the pulls by `k`.
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
//! - **Consequence.** A piece costs at least `pull`, so a sample whose whole micro-batch is
//!   pull-bound (`w(s) ≤ pull`: under about 6K tokens for the 7B profile across nodes) is never
//!   split: its pieces would each wait for the same pull as the whole sample.

use odc::Precision;
pub use odc_policy::split::{
    gang_sizes, piece_cost, DeviceAssignment, Gang, Link, PieceCost, SplitCosts, SplitOptions,
    SplitPlan, DEFAULT_TOKEN_BUDGET,
};

use super::profile::DeviceProfile;
use super::topology::{Topology, TopologyError};

/// Precision of the parameters a micro-batch pulls (ODC's published bf16 copy).
pub const PULL_PRECISION: Precision = Precision::Bf16;

/// What was wrong with a planning request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SplitError {
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error(transparent)]
    Plan(#[from] odc_policy::split::SplitError),
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

/// The modelled cluster as the planner's cost model (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Modelled<'a> {
    pub profile: &'a DeviceProfile,
    pub topology: &'a Topology,
}

impl SplitCosts for Modelled<'_> {
    fn devices(&self) -> u32 {
        self.topology.devices()
    }
    fn devices_per_node(&self) -> u32 {
        self.topology.gpus_per_node
    }
    fn fixed_s(&self) -> f64 {
        self.profile.fixed_s()
    }
    fn sample_s(&self, tokens: u64) -> f64 {
        self.profile.sample_s(tokens)
    }
    fn layer_attention_s(&self, tokens: u64) -> f64 {
        let block = self.profile.block();
        block.marginal_s(tokens) * block.attention_fraction(tokens)
    }
    fn attention_layers(&self) -> u32 {
        self.profile.block().count
    }
    fn kv_bytes_per_token(&self) -> u64 {
        self.profile.kv_bytes_per_token
    }
    fn ring_link(&self, inter_node: bool) -> Link {
        let (link, latency_s) = if inter_node {
            (self.topology.nic, self.topology.ring_step_inter_s)
        } else {
            (self.topology.nvlink, self.topology.ring_step_intra_s)
        };
        Link {
            bytes_per_s: link.bytes_per_s,
            latency_s,
        }
    }
    fn ring_step_overhead_s(&self, chunk_tokens: u64) -> f64 {
        self.profile.ring_step.seconds(chunk_tokens)
    }
    fn pull_s(&self) -> f64 {
        pull_s(self.profile, self.topology)
    }
}

/// The context-parallel cost of `tokens` over `k ≥ 2` devices of the modelled cluster.
pub fn context_parallel_cost(
    profile: &DeviceProfile,
    topology: &Topology,
    tokens: u64,
    k: u32,
) -> PieceCost {
    piece_cost(&Modelled { profile, topology }, tokens, k)
}

/// The modelled cluster's ring as a job's [`odc::RingPrice`], in cost units of
/// `seconds_per_cost` seconds (the runtime rows': `odc-bench sim` gives its job the profile's
/// block fit, so that its planner and its simulated device price a gang's ring as this model
/// does): the same layers, K/V bytes, hops, node size and ring steps.
pub fn ring_price(
    profile: &DeviceProfile,
    topology: &Topology,
    seconds_per_cost: f64,
) -> odc::RingPrice {
    let m = Modelled { profile, topology };
    let in_cost = |l: Link| Link {
        bytes_per_s: l.bytes_per_s * seconds_per_cost,
        latency_s: l.latency_s / seconds_per_cost,
    };
    let step = profile.ring_step;
    odc::RingPrice {
        layers: m.attention_layers(),
        kv_bytes_per_token: m.kv_bytes_per_token(),
        intra: in_cost(m.ring_link(false)),
        inter: in_cost(m.ring_link(true)),
        node_size: topology.gpus_per_node,
        step_s: f64::from(step.launches) * step.launch_s / seconds_per_cost,
        step_per_token_s: step.merge_bytes_per_token as f64
            / step.memory_bytes_per_s
            / seconds_per_cost,
    }
}

/// The modelled cluster's prices, once `topology` is checked.
fn modelled<'a>(
    profile: &'a DeviceProfile,
    topology: &'a Topology,
) -> Result<Modelled<'a>, SplitError> {
    topology.validate()?;
    Ok(Modelled { profile, topology })
}

/// Plans one lockstep step of `lengths` over the devices of `topology` as collective training
/// with context parallelism `cp` runs it (the baselines, [`odc_policy::split::plan_cp`]), priced
/// by the same model as [`plan`]. Dynamic CP's groups may span nodes (Megatron-Core's hybrid CP
/// builds groups up to the whole data-parallel world); a ring across nodes is priced on the NIC.
pub fn plan_cp(
    lengths: &[u64],
    profile: &DeviceProfile,
    topology: &Topology,
    cp: odc_policy::split::ContextParallel,
    token_budget: u64,
) -> Result<odc_policy::split::CpPlan, SplitError> {
    let costs = modelled(profile, topology)?;
    Ok(odc_policy::split::plan_cp(
        lengths,
        &costs,
        cp,
        token_budget,
        0,
    )?)
}

/// On-demand's plan for one step of `lengths` over the devices of `topology`, from the gangs'
/// plan [`plan`] made with the same `options`: the runtime's choice between its gangs and the CP
/// placements run without lockstep ([`odc_policy::split::weigh_placements`]).
pub fn plan_on_demand(
    gangs: SplitPlan,
    lengths: &[u64],
    profile: &DeviceProfile,
    topology: &Topology,
    options: SplitOptions,
) -> Result<odc_policy::split::OnDemandPlan, SplitError> {
    let costs = modelled(profile, topology)?;
    Ok(odc_policy::split::weigh_placements(
        gangs, lengths, &costs, options,
    )?)
}

/// Plans one step of `lengths` over the devices of `topology` with the runtime's planner.
pub fn plan(
    lengths: &[u64],
    profile: &DeviceProfile,
    topology: &Topology,
    options: SplitOptions,
) -> Result<SplitPlan, SplitError> {
    let costs = modelled(profile, topology)?;
    Ok(odc_policy::split::plan(lengths, &costs, options)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::profile::ModelShape;
    use crate::workload::Workload;

    /// The runtime rows' ring price, in cost units, charges what the modelled cluster does
    /// wherever the hop hides behind attention (the two differ only in the attention they hide
    /// behind: the block fit's quadratic term against the profile's curve) and on the NIC
    /// beyond a node.
    #[test]
    fn the_runtime_rows_ring_prices_as_the_modelled_cluster() {
        let profile = seven_b();
        let topology = Topology::h100(8, 8).unwrap();
        let spc = 28e-3;
        let block = profile.block();
        let costs = odc_policy::split::CostModelCosts {
            cost: odc::CostModel::quadratic(block.a_s * 1e3, block.b_s * 1e3),
            devices: 64,
            per_node: 8,
            ring: Some(ring_price(&profile, &topology, spc)),
        };
        let modelled = Modelled {
            profile: &profile,
            topology: &topology,
        };
        for (tokens, k) in [(65_536, 8), (131_072, 4), (16_384, 16), (262_144, 32)] {
            let runtime = piece_cost(&costs, tokens, k);
            let model = piece_cost(&modelled, tokens, k);
            assert_eq!(runtime.inter_node, model.inter_node, "{tokens} over {k}");
            let (got, want) = (runtime.comm_exposed_s * spc, model.comm_exposed_s);
            assert!(want > 0.0, "{tokens} over {k}: {model:?}");
            assert!(
                (got - want).abs() <= 0.02 * want,
                "{tokens} over {k}: runtime {got} s, model {want} s"
            );
        }
    }

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
        for g in &plan.gangs {
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
        assert!(unsplit.gangs.is_empty());
        assert_eq!(split.gangs.len(), 1);
        assert_eq!(split.gangs[0].sample, 0);
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
        assert!(with.gangs.is_empty());
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
        assert_eq!(on_fast.gangs.len(), 1);
        assert!(on_fast.step_s < on_slow.step_s);
        assert!(on_slow.gangs.is_empty(), "{:?}", on_slow.gangs);
        assert!((on_slow.step_s - on_slow.achievable_unsplit_s).abs() < 1e-9);
    }

    #[test]
    fn ring_attention_hides_behind_compute_for_long_sequences_on_nvlink() {
        let profile = seven_b();
        let topo = Topology::h100_devices(64).unwrap();
        let inside = context_parallel_cost(&profile, &topo, 65_536, 8);
        assert!(!inside.inter_node);
        // The hops hide; what shows is each step's own launches and merges.
        let steps = 28.0 * 7.0 * profile.ring_step.seconds(8192);
        assert!((inside.comm_exposed_s - steps).abs() < 1e-12, "{inside:?}");
        // Across nodes, short chunks: the NIC shows.
        let across = context_parallel_cost(&profile, &topo, 16_384, 64);
        assert!(across.inter_node);
        assert!(across.comm_exposed_s > 0.0, "{across:?}");
        // Never cheaper per rank than a sample of the chunk's length.
        assert!(across.compute_s >= profile.micro_batch_s(&[256]) - 1e-12);
    }

    #[test]
    fn a_ring_step_costs_its_launches_and_merges_a_larger_share_of_shorter_pieces() {
        let profile = seven_b();
        let topo = Topology::h100_devices(8).unwrap();
        let share = |tokens| {
            let c = context_parallel_cost(&profile, &topo, tokens, 8);
            c.comm_exposed_s / c.compute_s
        };
        let mut free = profile.clone();
        free.ring_step.launches = 0;
        free.ring_step.merge_bytes_per_token = 0;
        assert_eq!(
            context_parallel_cost(&free, &topo, 65_536, 8).comm_exposed_s,
            0.0
        );
        assert!(
            share(8192) > share(65_536),
            "{} vs {}",
            share(8192),
            share(65_536)
        );
        assert!(share(65_536) > 0.0);
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
        for k in gang_sizes(64, 8) {
            let c = context_parallel_cost(&profile, &topo, 2048, k);
            assert_eq!(c.transfer_s, across);
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
            ignored.gangs.iter().any(|g| g.sample == 0),
            "without pulls the 4K sample is split: {:?}",
            ignored.gangs
        );
        let profile = seven_b();
        let pull = pull_s(&profile, &topo);
        let whole = profile.micro_batch_s(&[4096]);
        assert!(
            whole > ignored.perfect_s && whole < pull,
            "{whole} vs {pull}"
        );
        for k in gang_sizes(64, 8) {
            let c = context_parallel_cost(&profile, &topo, 4096, k);
            assert!(c.piece_s() >= whole.max(pull), "k={k}: {c:?}");
        }
        let with = plan(&lengths, &profile, &topo, SplitOptions::default()).unwrap();
        assert!(with.gangs.is_empty(), "{:?}", with.gangs);
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
                ..SplitOptions::default()
            },
        )
        .unwrap_err();
        assert_eq!(
            err,
            SplitError::Plan(odc_policy::split::SplitError::NoBudget)
        );
        let empty = plan(&[], &profile, &topo, SplitOptions::default()).unwrap();
        assert_eq!((empty.step_s, empty.perfect_s), (0.0, 0.0));
    }
}
