//! The `odc-bench` command line: a dispatcher over its subcommands, one file each under `cli/`
//! — `ab` (on-demand vs collective), `sim` (the scale projection in virtual time), `transport`
//! (each backend beside the machine's limit), `processes` (N processes vs one), `sft-overhead`
//! (odc vs candle alone), `calibrate` (a simulator profile from measured compute), `memory` (a
//! trainer's bytes against length), `gang` (a long sample by one trainer vs a gang sharing it),
//! `lora-traffic`, `hf-make` and `hf-load`.
//!
//! Every input is checked before anything is allocated or run (limits in [`odc_bench::input`]);
//! an error is printed once, as `error: outer: cause: …`, and the exit status is 1 (2 for a flag
//! clap refuses).

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

mod cli;

use cli::*;
#[cfg(test)]
use odc_bench::input::MAX_SEQUENCE_TOKENS;

/// Counts live bytes for `odc-bench memory` (a relaxed atomic add per allocation elsewhere).
#[global_allocator]
static ALLOCATOR: odc_bench::memory::Counting = odc_bench::memory::Counting;

#[derive(Parser)]
#[command(
    name = "odc-bench",
    version,
    about = "odc-bench: the evidence for odc (on-demand vs collective communication)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Collective (FSDP-style) vs on-demand on the same simulated devices, workload and seed, in
    /// ABBA order, with a balanced control at every devices × minibatch × dispatch.
    Ab(AbArgs),
    /// Pull bandwidth of each transport backend (local, shm, tcp) at 4 KiB, 1 MiB and 64 MiB next
    /// to the machine's own limit measured in the same run (memcpy; a raw socket for tcp), in ABBA
    /// order, and the round-trip latency of a small pull. shm and tcp owners run in child
    /// processes.
    Transport(TransportArgs),
    /// Internal: the owner process of `odc-bench transport` (registers regions, prints their
    /// handles as one JSON line, serves until stdin closes).
    #[command(hide = true)]
    TransportOwner(OwnerArgs),
    /// Wall time per step of the `embed` example as N processes (`odc launch`, shm or tcp) next
    /// to the same job in one process, interleaved ABBA, with an A-vs-A control.
    Processes(ProcessesArgs),
    /// One SFT step of the reference transformer on odc (trainers and servers in one process,
    /// local transport, per-unit backward) vs the same step in candle alone, ABBA, with a
    /// candle-vs-candle control; tokens/s of both, and MFU on a GPU (`--device cuda`, feature
    /// `gpu`).
    SftOverhead(SftOverheadArgs),
    /// Per-unit forward + backward time against tokens per micro-batch for model presets, fitted
    /// as a·ŝ² + b·ŝ + c (ŝ = tokens / 32000), written as a profile for the simulator (`--json`;
    /// schema in odc_bench::calibrate).
    Calibrate(CalibrateArgs),
    /// Scale projection in virtual time: on-demand vs collective at 8–1,024 devices with the
    /// balanced control (the `ab` rows on tokio's paused clock, compute priced by an H100 device
    /// profile), and the long-sequence table: step time against perfect balance with and without
    /// context-parallel splitting (odc_bench::sim).
    Sim(SimArgs),
    /// A seeded random checkpoint in Hugging Face layout shaped like a public model
    /// (smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b, qwen2.5-1.5b), for `hf-load` and
    /// `sft-overhead --model-dir`.
    HfMake(HfMakeArgs),
    /// Sampled tokens/s of odc's batched sampler (KV cache, prompts left-padded together) on a
    /// Hugging Face model directory over GSM8K chat prompts; writes the prompts for the
    /// `transformers` peer (`benches/gpu/peer.py generate`).
    Generate(GenerateArgs),
    /// Loading a Hugging Face checkpoint: opening (every header checked) and converting every
    /// unit to f32 as the shard servers do, seconds and peak memory against the file size.
    HfLoad(HfLoadArgs),
    /// Bytes pulled and pushed per step with LoRA against full fine-tuning of the same model
    /// (a model directory or a shape), trainers and servers in one process.
    LoraTraffic(LoraTrafficArgs),
    /// Bytes a trainer holds while it trains one sample (a counting allocator; RSS beside it)
    /// against sequence length and depth, next to the analytical expectation, for the old path
    /// (no resharding, plain attention, MLP and head) and the new one (odc_bench::memory).
    Memory(MemoryArgs),
    /// One long sample's forward and backward by one trainer against a gang of trainers sharing
    /// it (sequence splitting: zig-zag chunks, keys and values over an in-process ring), on the
    /// real model, ABBA with an alone-vs-alone control (odc_bench::gang).
    Gang(GangArgs),
    /// What verifying a checkpoint costs against writing it: `odc::checkpoint::save` of a
    /// checkpoint of `--mb` MiB of parameters (and AdamW's moments) against CRC32C and SHA-256
    /// of the same bytes, seconds per GB.
    CheckpointIo(CheckpointIoArgs),
    /// What checkpointing costs a step: a job trains with no checkpoint, a synchronous one after
    /// every step and an asynchronous one after every step (ABBA), median step times and ratios.
    CheckpointStep(CheckpointStepArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
        .and_then(|runtime| match cli.command {
            Command::Ab(args) => runtime.block_on(ab(args)).map(drop),
            Command::Transport(args) => runtime.block_on(transport(args)),
            Command::TransportOwner(args) => runtime.block_on(transport_owner(args)),
            Command::Processes(args) => processes(args),
            Command::SftOverhead(args) => runtime.block_on(sft_overhead(args)),
            Command::Calibrate(args) => calibrate(args),
            Command::Sim(args) => runtime.block_on(sim(args)),
            Command::HfMake(args) => hf_make(args),
            Command::HfLoad(args) => hf_load(args),
            Command::Generate(args) => generate(args),
            Command::LoraTraffic(args) => runtime.block_on(lora_traffic(args)),
            Command::Memory(args) => runtime.block_on(memory(args)),
            Command::Gang(args) => gang(args),
            Command::CheckpointIo(args) => checkpoint_io(args),
            Command::CheckpointStep(args) => runtime.block_on(checkpoint_step(args)),
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", odc_bench::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_states_the_maximum_sequence_length() {
        let help = Cli::command()
            .find_subcommand_mut("ab")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(help.contains(&MAX_SEQUENCE_TOKENS.to_string()), "{help}");
        assert!(help.contains("MAX_SEQUENCE_TOKENS"), "{help}");
        assert_eq!(odc_bench::workload::MAX_SEQUENCE_TOKENS, 1 << 20);
    }
}
