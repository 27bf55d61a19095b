//! `odc-bench checkpoint-io`: what verifying a checkpoint costs against writing it. A checkpoint
//! of `--mb` MiB of fp32 parameters plus AdamW's two moments (`odc::checkpoint::save`: three
//! files, each synced, the manifest's CRC32C read back from the page cache, the rename and the
//! directory syncs) is written `--rounds` times into `--dir`; the same bytes are checksummed in
//! memory with CRC32C (what the manifest uses) and SHA-256 (the alternative the issue names).
//! Printed: seconds per GB of each, and each checksum as a fraction of the save.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use odc::checkpoint::{self, NamedTensor, TensorMap, TrainState};
use sha2::Digest as _;

#[derive(Args)]
pub(crate) struct CheckpointIoArgs {
    /// Parameters per checkpoint, in MiB of fp32 (the files hold three times this: parameters
    /// and two AdamW moments).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub(crate) mb: u64,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub(crate) rounds: u64,
    /// Where to write (a temporary directory by default; removed at the end).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
}

pub(crate) fn checkpoint_io(args: CheckpointIoArgs) -> anyhow::Result<()> {
    let elems = (args.mb << 20) as usize / 4;
    let units = 8usize;
    let per_unit = elems / units;
    let map = TensorMap::new(
        (0..units)
            .map(|u| vec![NamedTensor::new(format!("unit{u}.w"), &[per_unit])])
            .collect(),
    )?;
    let unit = |u: usize, scale: f32| -> Vec<f32> {
        (0..per_unit)
            .map(|i| ((i * 31 + u * 7) % 1000) as f32 * scale)
            .collect()
    };
    let state = TrainState {
        step: 1,
        params: (0..units).map(|u| unit(u, 1e-3)).collect(),
        optimizer: (0..units)
            .map(|u| adamw_state(unit(u, 1e-4), unit(u, 1e-6)))
            .collect(),
    };
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("odc-bench-checkpoint-io-{}", std::process::id()))
    });
    let bytes = 3 * per_unit * units * 4;
    let gb = bytes as f64 / 1e9;
    println!(
        "odc-bench checkpoint-io: {:.2} GB per checkpoint (3 files of {} MiB) in {}, {} rounds",
        gb,
        args.mb,
        dir.display(),
        args.rounds
    );
    // The checkpoint's bytes as the files hold them (little-endian fp32), to checksum in memory.
    let raw: Vec<u8> = state
        .params
        .iter()
        .map(Vec::as_slice)
        .chain(
            state
                .optimizer
                .iter()
                .flat_map(|o| o.buffers.iter().map(|(_, v)| &**v)),
        )
        .flat_map(|v| v.iter().flat_map(|x| x.to_le_bytes()))
        .collect();
    let (mut save_s, mut crc_s, mut sha_s) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        let t = Instant::now();
        let step = checkpoint::save(&dir, &map, &state, &serde_json::Value::Null)
            .with_context(|| format!("writing into {}", dir.display()))?;
        save_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let crc = crc32c::crc32c(&raw);
        crc_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let sha = sha2::Sha256::digest(&raw);
        sha_s.push(t.elapsed().as_secs_f64());
        std::hint::black_box((crc, sha));
        checkpoint::verify(&step).context("the checkpoint just written")?;
    }
    std::fs::remove_dir_all(&dir).ok();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (save, crc, sha) = (median(&mut save_s), median(&mut crc_s), median(&mut sha_s));
    println!("| what | s per GB | of the save |");
    println!("|---|---|---|");
    println!(
        "| save (write, sync, manifest, rename) | {:.3} | 1.00 |",
        save / gb
    );
    println!("| CRC32C in memory | {:.4} | {:.3} |", crc / gb, crc / save);
    println!(
        "| SHA-256 in memory | {:.4} | {:.3} |",
        sha / gb,
        sha / save
    );
    Ok(())
}

/// AdamW's state of one unit: its two moments.
fn adamw_state(exp_avg: Vec<f32>, exp_avg_sq: Vec<f32>) -> odc::layout::UnitOptimizerInit {
    odc::layout::UnitOptimizerInit {
        steps: 1,
        buffers: vec![
            ("exp_avg".into(), exp_avg.into()),
            ("exp_avg_sq".into(), exp_avg_sq.into()),
        ],
    }
}
