//! `odc-bench gang`: one long sample by one trainer against a gang sharing it (see
//! odc_bench::gang).

use anyhow::bail;
use clap::Args;

#[derive(Args)]
pub(crate) struct GangArgs {
    /// Tokens of the sample.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(4..=65_536))]
    pub(crate) tokens: u64,
    /// Members of the gang.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..=16))]
    pub(crate) members: u64,
    /// ABBA rounds (alone, gang, gang, alone).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub(crate) rounds: u64,
    /// The model: odc's reference model (`tiny`, the default) or a public shape
    /// (smollm2-135m, qwen2.5-0.5b, …) with seeded weights.
    #[arg(long, default_value = "tiny")]
    pub(crate) shape: String,
    /// Blocks of the model (default: the shape's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=128))]
    pub(crate) layers: Option<u64>,
}

/// The target of issue 29: a gang of 2 within 0.55 of one trainer's time.
const TARGET: f64 = 0.55;

pub(crate) fn gang(args: GangArgs) -> anyhow::Result<()> {
    let members = args.members as usize;
    // Every trainer, alone or in the gang, gets the same share of the host's cores.
    let threads = odc::model::share_cpu_threads(members);
    let mut config = match args.shape.as_str() {
        "tiny" => odc::model::ModelConfig::tiny(),
        shape => odc_bench::hf::shape(shape)?,
    };
    if let Some(layers) = args.layers {
        config.n_layers = layers as usize;
    }
    config.max_seq_len = config.max_seq_len.max(args.tokens as usize);
    config.validate()?;
    if args.tokens < 2 * args.members {
        bail!(
            "--tokens {} cannot be cut for {} members (two tokens each at least)",
            args.tokens,
            args.members
        );
    }
    println!(
        "odc-bench gang: {} ({} blocks, d_model {}), one sample of {} tokens, one trainer vs a \
         gang of {members}; {threads}; ABBA x {}",
        args.shape, config.n_layers, config.d_model, args.tokens, args.rounds
    );
    let report = odc_bench::gang::measure(
        &odc_bench::gang::GangOptions {
            config,
            tokens: args.tokens as usize,
            members,
            rounds: args.rounds as usize,
        },
        |line| println!("{line}"),
    )?;
    let verdict = match (members, report.ratio <= TARGET) {
        (2, true) => "met",
        (2, false) => "MISSED",
        _ => "no target",
    };
    println!(
        "gang of {members}: {:.3} of one trainer's time (perfect {:.3}; target for 2: <= {TARGET}: \
         {verdict}), control {:.3}, {} bytes sent per member per pass",
        report.ratio,
        1.0 / members as f64,
        report.control,
        report.sent_bytes_per_member
    );
    println!(
        "result gang members={members} tokens={} ratio={:.3} control={:.3} sent_bytes={} verdict={verdict}",
        args.tokens, report.ratio, report.control, report.sent_bytes_per_member
    );
    Ok(())
}
