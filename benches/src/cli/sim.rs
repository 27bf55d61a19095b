//! `odc-bench sim`: the scale projection in virtual time on a modelled cluster, and the long-
//! sequence table.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use odc_bench::ab::{self};
use odc_bench::input;

use super::*;

#[derive(Args)]
pub(crate) struct SimArgs {
    /// Sequence splitting in the runtime rows' on-demand side: off (default), auto, or N (see
    /// `ab --split`); the long-sequence table always plans both ways.
    #[arg(long, default_value = "off", value_parser = super::ab::split_policy)]
    pub(crate) split: odc::SplitPolicy,
    /// The runtime rows' collective baselines (see `ab --baselines`); the long-sequence table
    /// always plans FSDP, static CP of 2, 4 and 8, and dynamic CP.
    #[arg(long, value_delimiter = ',', default_value = "fsdp", value_parser = super::ab::context_parallel)]
    pub(crate) baselines: Vec<odc::ContextParallel>,
    /// Device counts (nodes of 8 GPUs in the long-sequence table).
    #[arg(long, value_delimiter = ',', value_parser = devices, default_value = "8,64,256,1024")]
    pub(crate) devices: Vec<usize>,
    /// Workloads: longalign, swesmith, rl, balanced (the balanced control runs at every device
    /// count anyway).
    #[arg(long, value_delimiter = ',', default_value = "longalign,swesmith,rl")]
    pub(crate) workloads: Vec<String>,
    /// A file of sequence lengths (one positive integer per line), as another workload.
    #[arg(long)]
    pub(crate) lengths: Option<PathBuf>,
    /// Samples per device in a minibatch.
    #[arg(long, default_value_t = 4, value_parser = per_device)]
    pub(crate) minibatch_per_device: usize,
    /// Minibatches per run.
    #[arg(long, default_value_t = 2, value_parser = steps)]
    pub(crate) steps: u64,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// The built-in H100 profile's layer shape (PAPERS.md's table): 7b or 1.5b.
    #[arg(long, default_value = "7b")]
    pub(crate) model: String,
    /// Transformer blocks of the modelled model.
    #[arg(long, default_value_t = 28)]
    pub(crate) layers: u32,
    /// A profile of measured points (`odc-bench calibrate --json`) to use instead of the
    /// built-in table; `--model` then names its model (or `block-<model>`).
    #[arg(long)]
    pub(crate) profile: Option<PathBuf>,
    /// On-demand dispatch. `static` (default, ODC's LB-Mini): each device's samples packed into
    /// as few micro-batches as the token budget allows. `dynamic` makes more, smaller
    /// micro-batches; with links modelled each pays a full parameter gather and gradient push,
    /// which from 64 devices costs more than it balances.
    #[arg(long, value_enum, default_value = "static")]
    pub(crate) dispatch: Dispatch,
    /// Devices per shard server in the runtime rows (default: one server for all devices). The
    /// modelled placement stays one shard per device (a server's regions are striped over its
    /// devices' links), so this only changes the simulation's cost: one server is the cheapest
    /// (one read per gather).
    #[arg(long, value_parser = devices)]
    pub(crate) devices_per_server: Option<usize>,
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    /// Units the runtime rows' emulated model is cut into (default: `--layers`, one per block, as
    /// odc pulls and pushes). The first unit's pull and the last one's push of a micro-batch are
    /// not hidden behind compute, so coarser units overstate that exposure (4 units of 7 blocks:
    /// the balanced control reads 0.98x instead of 1.00x); fewer run faster.
    #[arg(long)]
    pub(crate) units: Option<u32>,
    /// Skip the runtime rows (only the long-sequence table, from the models).
    #[arg(long)]
    pub(crate) no_runtime: bool,
    /// The long-sequence table's tokens per trainer and micro-batch, the memory a trainer has
    /// (default: the workload's longest sample, rounded up to a power of two, at least 16,384):
    /// below the longest sample FSDP without CP cannot run it and TE-style CP picks the
    /// smallest group that fits.
    #[arg(long, value_parser = super::token_budget)]
    pub(crate) token_budget: Option<u64>,
    /// Costs the planner cannot see, for a third table (`odc_bench::sim::noise`) and paid by the
    /// runtime rows' simulated device (not by their balanced controls): `calibrated` (the pack
    /// estimate's measured errors, 5% per-layer jitter, one straggler at 0.8x per 64 devices),
    /// `SAMPLE,LAYER` log-σs (e.g. `0.1,0.05`), or `off` (the table at zero noise: the planned
    /// steps, a control). Without it, no third table.
    #[arg(long, value_parser = super::noise_arg)]
    pub(crate) noise: Option<NoiseArg>,
    /// One device in N at 0.8x under `--noise` (default 64 with `calibrated`, else 0: none).
    #[arg(long)]
    pub(crate) straggler_every: Option<u32>,
    /// Write the runtime rows as JSON (and PATH.split.json: the long-sequence table).
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Write an SVG of speedup against devices, as ODC's figure: on-demand/collective per workload
    /// (runtime rows), and on-demand/achievable with the long-sequence table's step time against
    /// perfect balance without and with splitting.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
}

/// The modelled cluster of `odc-bench sim` and `odc-bench ab`.
#[derive(Args, Clone)]
pub(crate) struct ClusterArgs {
    /// Links: `h100` = nodes of `--gpus-per-node` H100s, NVLink 450 GB/s inside a node, a
    /// 400 Gb/s NIC per GPU across nodes, as FIFO queues per device and direction; `none` =
    /// communication is free in virtual time (`ab`: or `--unit-transfer-ms`'s one link per
    /// device). Default: `h100` for `sim`, `none` for `ab`.
    #[arg(long, value_enum)]
    pub(crate) links: Option<LinksArg>,
    #[arg(long, default_value_t = 8, value_parser = gpus_per_node)]
    pub(crate) gpus_per_node: u32,
    /// Turn off ODC's hierarchical partitioning (HPZ, on by default): the first pull of a unit in a
    /// node leaves a copy there, spread over its GPUs; the node's later pulls of it stay on
    /// NVLink.
    #[arg(long)]
    pub(crate) no_hpz: bool,
    /// On-demand cross-node transfers: `striped` (default: over every NIC of the node through
    /// NVLink proxies, Zeppelin's routing layer) or `direct` (source and destination NICs only).
    /// The collective's ring always crosses nodes on every NIC (NCCL's channels).
    #[arg(long, value_enum, default_value = "striped")]
    pub(crate) routing: RoutingArg,
    /// What parameters are pulled (on-demand) and all-gathered (collective) as. Default: bf16 for
    /// `sim`, f32 for `ab`.
    #[arg(long, value_enum)]
    pub(crate) pull_precision: Option<PrecisionArg>,
    /// Do not price a micro-batch's transfers in the on-demand planner's cost model (priced by
    /// default on a modelled cluster: each micro-batch lasts at least its pulls and pushes,
    /// `LinksConfig::transfer_s`): the planner then prices compute only.
    #[arg(long)]
    pub(crate) no_transfer_price: bool,
    /// Relay on-demand gradient pushes through the node (`JobBuilder::relay_pushes`): a
    /// trainer pushes an off-node shard into its node's relay over NVLink, and each relay
    /// crosses the NIC once per step, at the barrier. Needs shard servers inside nodes (`sim`
    /// then defaults `--devices-per-server` to `--gpus-per-node`).
    #[arg(long)]
    pub(crate) relay_pushes: bool,
}

impl ClusterArgs {
    /// The modelled cluster, if `--links h100` (`sim` sets it by default), at `bytes_scale`
    /// modelled bytes per emulated byte.
    pub(crate) fn links_config(&self, bytes_scale: f64) -> Option<odc_bench::links::LinksConfig> {
        (self.links == Some(LinksArg::H100)).then_some(odc_bench::links::LinksConfig {
            gpus_per_node: self.gpus_per_node,
            routing: match self.routing {
                RoutingArg::Direct => odc_bench::sim::topology::Routing::Direct,
                RoutingArg::Striped => odc_bench::sim::topology::Routing::Striped,
            },
            hpz: !self.no_hpz,
            bytes_scale,
            relay: self.relay_pushes,
        })
    }

    /// The pull precision (fp32 without `--pull-precision`; `sim` sets bf16 by default).
    pub(crate) fn precision(&self) -> odc::Precision {
        match self.pull_precision {
            Some(PrecisionArg::Bf16) => odc::Precision::Bf16,
            None | Some(PrecisionArg::F32) => odc::Precision::F32,
        }
    }
}

/// `--links`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LinksArg {
    H100,
    None,
}

/// `--routing`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RoutingArg {
    Direct,
    Striped,
}

/// `--pull-precision`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrecisionArg {
    Bf16,
    F32,
}

pub(crate) fn bytes_scale(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && (1.0..=1e9).contains(&x) => Ok(x),
        _ => Err(format!(
            "{s:?}: the bytes scale must be a number from 1 to 1e9"
        )),
    }
}

pub(crate) fn gpus_per_node(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(g @ 1..=64) => Ok(g),
        _ => Err(format!(
            "{s:?}: GPUs per node must be an integer from 1 to 64"
        )),
    }
}

/// `odc-bench sim`: the `ab` matrix on the virtual clock with an H100 profile's cost, then the
/// long-sequence table of `odc_bench::sim::report`.
pub(crate) async fn sim(args: SimArgs) -> anyhow::Result<()> {
    use odc_bench::sim::profile::{DeviceProfile, ModelShape};
    use odc_bench::sim::report::{baseline_table, join, joined_table, split_rows, split_table};

    let profile = match &args.profile {
        Some(path) => DeviceProfile::from_file(path, &args.model, args.layers)?,
        None => DeviceProfile::builtin(args.model.parse::<ModelShape>()?, args.layers)?,
    };
    let split_path = args.json.as_ref().map(|p| with_suffix(p, ".split.json"));
    if let Some(path) = &split_path {
        input::check_output("--json", path)?;
    }
    if let Some(path) = &args.plot {
        input::check_output("--plot", path)?;
    }
    let workloads = workloads(&sim_ab_args(&args, None))?;
    // The runtime's cost model is the profile's block fit `a·ŝ² + b·ŝ` (seconds per block),
    // times the blocks: 1 cost unit = layers × 1 ms.
    let block = profile.block();
    let cost = odc::CostModel::quadratic(block.a_s * 1e3, block.b_s * 1e3);
    println!(
        "odc-bench sim: profile {} ({} blocks of {} M parameters); runtime rows priced by its fit a = {:.2} ms, b = {:.2} ms per block (ŝ = tokens / 32,000), {}",
        profile.source,
        profile.layers,
        profile.layer_params / 1_000_000,
        block.a_s * 1e3,
        block.b_s * 1e3,
        if args.cluster.links == Some(LinksArg::None) {
            "no link model (communication free)"
        } else {
            "links of H100 nodes"
        }
    );
    let runtime = if args.no_runtime {
        Vec::new()
    } else {
        let name = format!("{} fit × {} blocks", profile.source, profile.layers);
        let mut ab_args = sim_ab_args(&args, Some((cost, name)));
        // `sim`'s defaults: links of H100 nodes, bf16 pulls; one emulated element stands for
        // `layers / units` blocks' parameters.
        ab_args.cluster.links.get_or_insert(LinksArg::H100);
        ab_args
            .cluster
            .pull_precision
            .get_or_insert(PrecisionArg::Bf16);
        let modelled_unit = profile.layer_params as f64 * f64::from(profile.layers);
        ab_args.bytes_scale = modelled_unit / (ab_args.units * ab_args.unit_elems) as f64;
        // On the modelled cluster a gang's ring costs what the long-sequence table charges it.
        if ab_args.cluster.links == Some(LinksArg::H100) {
            let topology = odc_bench::sim::topology::Topology::h100(1, args.cluster.gpus_per_node)?;
            ab_args.ring = Some(odc_bench::sim::split::ring_price(
                &profile,
                &topology,
                ab_args.time_scale_ms / 1e3,
            ));
        }
        ab(ab_args).await?.rows
    };

    println!();
    println!(
        "Long sequences: step time against perfect balance without and with context-parallel splitting ({} samples per device, nodes of 8 H100s; modelled from the profile and the topology, not measured)",
        args.minibatch_per_device
    );
    let devices: Vec<u32> = args.devices.iter().map(|&d| d as u32).collect();
    let mut rows = Vec::new();
    for w in workloads.iter().filter(|w| w.name() != "balanced") {
        let budget = args
            .token_budget
            .unwrap_or_else(|| ab::default_token_budget(w));
        rows.extend(split_rows(
            w,
            &devices,
            args.minibatch_per_device,
            args.seed,
            &profile,
            budget,
        )?);
    }
    print!("{}", split_table(&rows));
    println!();
    println!(
        "Against collectives that split too (modelled, lockstep rounds, the same prices): FSDP with LB-Micro, static CP as TransformerEngine's users run it (TE CP: one size for the job, the smallest whose pieces fit the longest sample in the token budget; * where its groups span nodes), the best static CP of 2, 4, …, 64 per row (a bound: every sample over a fixed group), dynamic CP (a group size per sample); each baseline's step over on-demand's split step"
    );
    print!("{}", baseline_table(&rows));
    if let Some(arg) = args.noise {
        let noise = arg.noise(args.seed, args.straggler_every);
        let (sample_sigma, layer_sigma) = (noise.sample_sigma, noise.layer_sigma);
        println!();
        println!(
            "Under costs the planner cannot see (modelled; every plan made with the estimates, the run paying per-sample errors of log-sigma {sample_sigma}, per-layer jitter of log-sigma {layer_sigma}, {}; the same draws for every side): lockstep sides wait for the slowest device at every layer, on demand only for its gangs' members",
            match noise.straggler_every {
                0 => "no straggler".to_string(),
                n => format!("one device in {n} at 0.8x"),
            }
        );
        let mut noisy = Vec::new();
        for w in workloads.iter().filter(|w| w.name() != "balanced") {
            let budget = args
                .token_budget
                .unwrap_or_else(|| ab::default_token_budget(w));
            noisy.extend(odc_bench::sim::report::noise_rows(
                w,
                &devices,
                args.minibatch_per_device,
                args.seed,
                &profile,
                budget,
                &noise,
            )?);
        }
        print!("{}", odc_bench::sim::report::noise_table(&noisy));
    }
    if !runtime.is_empty() {
        println!();
        println!(
            "Runtime rows (virtual time) beside the model's splitting columns, per workload and device count:"
        );
        print!("{}", joined_table(&join(&runtime, &rows)));
    }
    if let Some(path) = &split_path {
        let json = serde_json::json!({ "profile": profile.source, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        odc_bench::sim::plot::write(path, &profile.source, profile.layers, &runtime, &rows)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// The `ab` arguments of `odc-bench sim`'s runtime rows: virtual clock, one repetition, no
/// straggler, the balanced control on.
pub(crate) fn sim_ab_args(args: &SimArgs, cost: Option<(odc::CostModel, String)>) -> AbArgs {
    AbArgs {
        quick: false,
        workloads: args.workloads.clone(),
        lengths: args.lengths.clone(),
        devices: args.devices.clone(),
        minibatch_per_device: vec![args.minibatch_per_device],
        dispatch: vec![args.dispatch],
        token_budget: None,
        steps: args.steps,
        reps: 1,
        seed: args.seed,
        // 1 cost unit = 1 ms per block.
        time_scale_ms: f64::from(args.layers.max(1)),
        unit_elems: 16 * 1024,
        unit_transfer_ms: 0.0,
        units: args.units.unwrap_or(args.layers).max(1) as usize,
        no_straggler: true,
        no_control: false,
        json: args.json.clone(),
        // `sim` draws its own plot from the rows.
        plot: None,
        trace: None,
        clock: ClockArg::Virtual,
        // One server for every row by default: the largest row's device count.
        devices_per_server: args.devices_per_server.unwrap_or_else(|| {
            if args.cluster.relay_pushes {
                args.cluster.gpus_per_node as usize
            } else {
                args.devices.iter().copied().max().unwrap_or(1)
            }
        }),
        cost,
        ring: None,
        cluster: args.cluster.clone(),
        bytes_scale: 1.0,
        split: args.split,
        baselines: args.baselines.clone(),
        noise: args.noise,
        straggler_every: args.straggler_every,
    }
}
