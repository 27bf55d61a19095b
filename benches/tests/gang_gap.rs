//! Why on-demand's own gang planner trails dynamic CP (`docs/splitting.md`,
//! "Why the gangs trail dynamic CP"): the same planners on the modelled 7B cluster at 64
//! devices, once as priced and once with a micro-batch's fixed cost and its transfers free.
//!
//! What it shows (asserted where the claim is the doc's):
//! - at 4 samples a device the gangs trail only by what their micro-batches cost (each piece is
//!   a micro-batch of its own, paying the fixed cost and, where its compute is short, its
//!   transfers; dynamic CP's cells share them): with those free, the gangs' step is within 1%
//!   of dynamic CP's (run without lockstep) or shorter;
//! - at 1 sample a device they trail also with them free: a gang holds its members for its
//!   piece, where dynamic CP's cells run a piece beside whole samples in one micro-batch.
//!
//! `cargo test -p odc-bench --test gang_gap -- --nocapture` prints the table; with
//! `ODC_HEAVY_LENGTHS=FILE` (one length a line) a heavy tail's rows too.

use odc_bench::sim::profile::{DeviceProfile, ModelShape};
use odc_bench::sim::split::Modelled;
use odc_bench::sim::topology::Topology;
use odc_bench::workload::Workload;
use odc_policy::split::{
    plan, plan_cp, unlocked_step_s, ContextParallel, Link, SplitCosts, SplitOptions,
};

/// The modelled cluster, with (`free`) no fixed cost and no transfers per micro-batch.
struct Priced<'a> {
    cluster: Modelled<'a>,
    free: bool,
}

impl SplitCosts for Priced<'_> {
    fn devices(&self) -> u32 {
        self.cluster.devices()
    }
    fn devices_per_node(&self) -> u32 {
        self.cluster.devices_per_node()
    }
    fn fixed_s(&self) -> f64 {
        self.unless_free(self.cluster.fixed_s())
    }
    fn sample_s(&self, tokens: u64) -> f64 {
        self.cluster.sample_s(tokens)
    }
    fn layer_attention_s(&self, tokens: u64) -> f64 {
        self.cluster.layer_attention_s(tokens)
    }
    fn attention_layers(&self) -> u32 {
        self.cluster.attention_layers()
    }
    fn kv_bytes_per_token(&self) -> u64 {
        self.cluster.kv_bytes_per_token()
    }
    fn ring_link(&self, inter_node: bool) -> Link {
        self.cluster.ring_link(inter_node)
    }
    fn ring_step_overhead_s(&self, chunk_tokens: u64) -> f64 {
        self.cluster.ring_step_overhead_s(chunk_tokens)
    }
    fn pull_s(&self) -> f64 {
        self.unless_free(self.cluster.pull_s())
    }
}

impl Priced<'_> {
    /// A per-micro-batch price: `seconds`, or nothing where micro-batches are free.
    fn unless_free(&self, seconds: f64) -> f64 {
        if self.free {
            0.0
        } else {
            seconds
        }
    }
}

/// (gangs' step, their micro-batches and pieces, dynamic CP's step without lockstep, its cells).
fn steps(lengths: &[u64], costs: &Priced<'_>, budget: u64) -> (f64, usize, f64, usize) {
    let options = SplitOptions {
        token_budget: budget,
        ..SplitOptions::default()
    };
    let gangs = plan(lengths, costs, options).expect("gangs");
    let dcp = plan_cp(lengths, costs, ContextParallel::Dynamic, budget, 0).expect("dcp");
    let runs = gangs
        .devices
        .iter()
        .map(|a| a.micro_batches.len() + a.pieces.len())
        .sum();
    let cells = dcp
        .rounds
        .iter()
        .flatten()
        .filter(|c| !c.samples.is_empty() || !c.pieces.is_empty())
        .count();
    (gangs.step_s, runs, unlocked_step_s(&dcp), cells)
}

#[test]
fn gangs_trail_dynamic_cp_at_4_samples_a_device_only_by_what_their_micro_batches_cost() {
    let profile = DeviceProfile::builtin(ModelShape::B7, 28).expect("profile");
    let mut workloads: Vec<Workload> = ["longalign", "rl", "swesmith"]
        .iter()
        .map(|n| Workload::from_name(n).expect("workload"))
        .collect();
    match std::env::var_os("ODC_HEAVY_LENGTHS") {
        Some(path) => workloads.push(Workload::from_file(path.as_ref()).expect("lengths")),
        None => eprintln!("(no ODC_HEAVY_LENGTHS: the heavy tail's rows are not run)"),
    }
    let d = 64;
    let topology = Topology::h100_devices(d).expect("topology");
    println!("| workload | samples/device | priced: gangs / dcp (s) | gangs' micro-batches / dcp's cells | free: gangs / dcp (s) |");
    println!("|---|---|---|---|---|");
    for w in &workloads {
        let budget = w.max_tokens().max(65_536);
        for per in [4, 1] {
            let lengths = w.sample(per * d as usize, 0);
            let cost = |free| Priced {
                cluster: Modelled {
                    profile: &profile,
                    topology: &topology,
                },
                free,
            };
            let (gangs, runs, dcp, cells) = steps(&lengths, &cost(false), budget);
            let (free_gangs, _, free_dcp, _) = steps(&lengths, &cost(true), budget);
            println!(
                "| {} | {per} | {gangs:.3} / {dcp:.3} ({:.2}x) | {runs} / {cells} | {free_gangs:.3} / {free_dcp:.3} ({:.2}x) |",
                w.name(),
                dcp / gangs,
                free_dcp / free_gangs,
            );
            if per == 4 {
                assert!(
                    free_gangs <= 1.01 * free_dcp,
                    "{}: with micro-batches free the gangs take {free_gangs} s, dcp {free_dcp} s",
                    w.name()
                );
            }
        }
    }
}
