//! `odc-bench hf-make` (a seeded random checkpoint of a public shape) and `odc-bench hf-load`
//! (opening and converting one).

use std::path::PathBuf;

use anyhow::bail;
use clap::Args;

#[derive(Args)]
pub(crate) struct HfMakeArgs {
    /// smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b or qwen2.5-1.5b.
    #[arg(long)]
    pub(crate) shape: String,
    /// bf16 or f32 on disk.
    #[arg(long, default_value = "bf16")]
    pub(crate) dtype: String,
    /// The directory to write (must not exist, or be empty).
    #[arg(long)]
    pub(crate) out: PathBuf,
}

#[derive(Args)]
pub(crate) struct HfLoadArgs {
    /// The model directory.
    #[arg(long)]
    pub(crate) model_dir: PathBuf,
    /// Shard servers the conversion is split over.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) servers: u32,
}

pub(crate) fn hf_make(args: HfMakeArgs) -> anyhow::Result<()> {
    use odc::model::hf::ExportDtype;
    let config = odc_bench::hf::shape(&args.shape)?;
    let dtype = match args.dtype.as_str() {
        "bf16" => ExportDtype::Bf16,
        "f32" => ExportDtype::F32,
        other => bail!("--dtype {other:?}: expected bf16 or f32"),
    };
    let started = std::time::Instant::now();
    let summary = odc_bench::hf::make(&config, dtype, &args.out)?;
    println!(
        "odc-bench hf-make: {} ({} parameters) in {}: {} file(s), {:.1} MB of tensors, {:.1} s",
        args.shape,
        odc::model::param_count(&config)?,
        args.out.display(),
        summary.safetensors_files.len(),
        summary.tensor_bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) fn hf_load(args: HfLoadArgs) -> anyhow::Result<()> {
    let r = odc_bench::hf::load(&args.model_dir, args.servers as usize)?;
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "odc-bench hf-load: {} ({} parameters, {:.1} MB on disk), {} server(s)\n\
         open (config, headers, every tensor checked) {:.3} s; convert to f32 masters {:.3} s \
         ({:.0} MB/s of file, {:.1} MB of f32, largest slice {:.1} MB)\n\
         peak resident {:.1} MB (before opening {:.1} MB); at the end resident anonymous {:.1} MB, \
         file-backed {:.1} MB",
        args.model_dir.display(),
        r.parameters,
        mb(r.file_bytes),
        args.servers,
        r.open_s,
        r.convert_s,
        mb(r.file_bytes) / r.convert_s.max(1e-9),
        mb(r.f32_bytes),
        mb(r.largest_slice_bytes),
        mb(r.peak_rss),
        mb(r.peak_rss_before),
        mb(r.rss_anon),
        mb(r.rss_file)
    );
    println!(
        "result hf-load parameters={} file_bytes={} open_s={:.4} convert_s={:.4} peak_rss_bytes={} \
         peak_rss_before_bytes={} largest_slice_bytes={}",
        r.parameters,
        r.file_bytes,
        r.open_s,
        r.convert_s,
        r.peak_rss,
        r.peak_rss_before,
        r.largest_slice_bytes
    );
    Ok(())
}
