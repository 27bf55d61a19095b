//! The checkpoints of `tests/fixtures/hf/` (made by Python `transformers`, `scripts/hf_fixtures.py`)
//! and odc's logits of them (`#[path]`-included by the test binaries that compare against them).

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use odc::model::{model_forward, ModelConfig, PackedBatch, Sample};

/// Every case's directory, in name order (there are four).
pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("tests/fixtures/hf")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    assert_eq!(cases.len(), 4, "{cases:?}");
    cases
}

/// A case as odc opens it: its name, its model's config, every unit's values, and the tokens of
/// its `logits.json`.
#[allow(dead_code)] // not every binary that includes this opens a case whole
pub fn open(dir: &Path) -> (String, ModelConfig, Vec<Vec<f32>>, Vec<u32>) {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let checkpoint = odc::model::hf::HfCheckpoint::open(dir).expect("odc opens the checkpoint");
    let units = checkpoint.all_unit_values().unwrap();
    let fixture = json(&dir.join("logits.json"));
    let tokens: Vec<u32> = serde_json::from_value(fixture["tokens"].clone()).unwrap();
    (name, checkpoint.config().clone(), units, tokens)
}

/// A case's JSON file.
pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("a fixture")).expect("json")
}

/// odc's training forward of `units` on a pack of `before`, then `tokens`: the logits at
/// `tokens`' positions.
pub fn packed_logits(
    config: &ModelConfig,
    units: &[Vec<f32>],
    before: &[u32],
    tokens: &[u32],
) -> Tensor {
    let device = Device::Cpu;
    let params: Vec<Vec<Tensor>> = units
        .iter()
        .enumerate()
        .map(|(u, v)| {
            let specs = odc::model::unit_params(config, u).unwrap();
            odc::model::unit_tensors(v, &specs, &device).unwrap()
        })
        .collect();
    let pack = [
        Sample::all_loss(before.to_vec()),
        Sample::all_loss(tokens.to_vec()),
    ];
    let batch = PackedBatch::pack(config, &pack, &device).unwrap();
    let logits = model_forward(config, &params, &batch)
        .unwrap()
        .logits
        .unwrap();
    logits.narrow(0, before.len(), tokens.len()).unwrap()
}

/// `max |a − b|`; fails on different shapes or a non-finite difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let diff: Vec<f32> = (a - b).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(diff.iter().all(|d| d.is_finite()), "a non-finite logit");
    diff.iter().fold(0.0, |m, d| m.max(d.abs()))
}
