//! [`save`] and [`load`]: a [`TrainState`] as `step-<N>/{model,optimizer}.safetensors`,
//! `state.json` and the [`manifest`](super::manifest) (see the [module docs](super)). A frozen unit's optimizer state is 0 steps and no
//! buffers: `state.json` says so and the optimizer file holds no tensor of it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::error::{invalid, io, CheckpointError};
use super::layout::{
    fresh_staging, publish, StateFile, FILES, FORMAT, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE,
};
use super::manifest;
use super::{TensorMap, TrainState};

/// Writes `state` (split into `tensors`' names) and `extra` to `dir/step-<state.step>` and returns
/// that directory.
///
/// **Durable and atomic**: the files are written into a staging directory beside the final name,
/// each synced; the manifest (sizes and CRC32C of the three files) is written last and synced,
/// then the staging directory itself; it is renamed into place and `dir` is synced. After a power
/// loss the step directory is either absent or complete and verifiable. An existing one of the
/// same step is moved aside before the rename and removed after it.
pub fn save(
    dir: &Path,
    tensors: &TensorMap,
    state: &TrainState,
    extra: &serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    let lens: Vec<usize> = state.params.iter().map(Vec::len).collect();
    tensors.check_lens("the parameters", &lens)?;
    if state.optimizer.len() != lens.len() {
        return Err(CheckpointError::Map(format!(
            "optimizer state for {} units, the model has {}",
            state.optimizer.len(),
            lens.len()
        )));
    }
    for (u, opt) in state.optimizer.iter().enumerate() {
        for (name, values) in &opt.buffers {
            if values.len() != lens[u] {
                return Err(CheckpointError::Map(format!(
                    "optimizer buffer `{name}` of unit {u} has {} elements, the unit {}",
                    values.len(),
                    lens[u]
                )));
            }
        }
    }
    let staging = fresh_staging(dir, state.step)?;

    let model: Vec<(String, &[f32], Vec<usize>)> = tensors
        .units()
        .iter()
        .zip(&state.params)
        .flat_map(|(named, values)| split(named, values))
        .collect();
    write_tensors(&staging.join(MODEL_FILE), &model)?;
    drop(model);
    let mut optimizer = Vec::new();
    for (named, opt) in tensors.units().iter().zip(&state.optimizer) {
        for (buffer, values) in &opt.buffers {
            for (name, slice, shape) in split(named, values) {
                optimizer.push((format!("{name}.{buffer}"), slice, shape));
            }
        }
    }
    write_tensors(&staging.join(OPTIMIZER_FILE), &optimizer)?;
    let state_file = StateFile {
        format: FORMAT,
        step: state.step,
        units: tensors
            .units()
            .iter()
            .map(|u| u.iter().map(|t| t.name.clone()).collect())
            .collect(),
        optimizer_steps: state.optimizer.iter().map(|o| o.steps).collect(),
        optimizer_buffers: state
            .optimizer
            .iter()
            .map(|o| o.buffers.iter().map(|(n, _)| n.clone()).collect())
            .collect(),
        extra: extra.clone(),
        shards: Vec::new(),
    };
    let json_path = staging.join(STATE_FILE);
    let json = serde_json::to_vec_pretty(&state_file)
        .map_err(|e| invalid(&json_path, format!("cannot encode: {e}")))?;
    manifest::write_synced(&json_path, &json)?;
    publish(dir, &staging, state.step, Vec::new(), &FILES)
}

/// Reads the checkpoint in `step_dir` (a `DIR/step-<N>` that [`save`] or a sharded checkpoint
/// wrote) for a model whose tensors are `tensors`: the whole state and the caller's JSON. Every
/// file is checked against the manifest (size and CRC32C) before it is parsed: a missing
/// manifest, or a file that does not match it, is an error naming the file. To resume a job
/// without the whole state in one process, [`open`](super::open) it instead.
pub fn load(
    step_dir: &Path,
    tensors: &TensorMap,
) -> Result<(TrainState, serde_json::Value), CheckpointError> {
    let opened = super::open(step_dir, tensors)?;
    Ok((opened.read_all()?, opened.extra().clone()))
}

/// A unit's flat `values` as its named tensors.
fn split<'a>(
    named: &'a [super::NamedTensor],
    values: &'a [f32],
) -> impl Iterator<Item = (String, &'a [f32], Vec<usize>)> + 'a {
    let mut at = 0;
    named.iter().map(move |t| {
        let n = t.numel();
        let slice = &values[at..at + n];
        at += n;
        (t.name.clone(), slice, t.shape.clone())
    })
}

fn write_tensors(
    path: &Path,
    tensors: &[(String, &[f32], Vec<usize>)],
) -> Result<(), CheckpointError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, values, _)| values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, _, shape), data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| invalid(path, format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "odc".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| invalid(path, format!("cannot write: {e}")))?;
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::super::NamedTensor;
    use super::*;
    use crate::test_util::temp_path;
    use odc_policy::layout::UnitOptimizerInit;
    use safetensors::SafeTensors;

    fn map() -> TensorMap {
        TensorMap::new(vec![
            vec![NamedTensor::new("embed.weight", &[3, 2])],
            vec![
                NamedTensor::new("layers.0.norm", &[2]),
                NamedTensor::new("layers.0.w", &[2, 2]),
            ],
        ])
        .unwrap()
    }

    fn state() -> TrainState {
        let unit = |n: usize, base: f32| (0..n).map(|i| base + i as f32 * 0.25).collect::<Vec<_>>();
        TrainState {
            step: 7,
            params: vec![unit(6, 1.0), unit(6, -2.0)],
            optimizer: vec![
                UnitOptimizerInit {
                    steps: 7,
                    buffers: vec![
                        ("exp_avg".into(), unit(6, 0.5).into()),
                        ("exp_avg_sq".into(), unit(6, 0.125).into()),
                    ],
                },
                UnitOptimizerInit {
                    steps: 7,
                    buffers: vec![
                        ("exp_avg".into(), unit(6, 3.0).into()),
                        ("exp_avg_sq".into(), unit(6, 4.0).into()),
                    ],
                },
            ],
        }
    }

    #[test]
    fn round_trip_is_exact_and_keeps_the_callers_json() {
        let dir = temp_path("odc-ckpt", "round-trip");
        let extra = serde_json::json!({"data_position": 42, "rng": [1, 2, 3]});
        let step = save(&dir, &map(), &state(), &extra).unwrap();
        assert_eq!(step, dir.join("step-7"));
        let (loaded, back) = load(&step, &map()).unwrap();
        assert_eq!(loaded, state());
        assert_eq!(back, extra);
        // Tensor names are the model's; shapes as declared.
        let bytes = std::fs::read(step.join(MODEL_FILE)).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = file.names();
        names.sort();
        assert_eq!(names, vec!["embed.weight", "layers.0.norm", "layers.0.w"]);
        assert_eq!(file.tensor("layers.0.w").unwrap().shape(), &[2, 2]);
        let bytes = std::fs::read(step.join(OPTIMIZER_FILE)).unwrap();
        let opt = SafeTensors::deserialize(&bytes).unwrap();
        assert!(opt.tensor("layers.0.w.exp_avg_sq").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A frozen unit has no optimizer state (0 steps, no buffers): nothing of it is written to
    /// the optimizer file, and it reads back as it was.
    #[test]
    fn a_frozen_units_empty_optimizer_state_round_trips() {
        let dir = temp_path("odc-ckpt", "frozen");
        let mut frozen = state();
        frozen.optimizer[0] = UnitOptimizerInit::default();
        let step = save(&dir, &map(), &frozen, &serde_json::Value::Null).unwrap();
        let (loaded, _) = load(&step, &map()).unwrap();
        assert_eq!(loaded, frozen);
        let bytes = std::fs::read(step.join(OPTIMIZER_FILE)).unwrap();
        let opt = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = opt.names();
        names.sort();
        assert_eq!(
            names,
            vec![
                "layers.0.norm.exp_avg",
                "layers.0.norm.exp_avg_sq",
                "layers.0.w.exp_avg",
                "layers.0.w.exp_avg_sq"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_file_is_an_error_naming_it() {
        let dir = temp_path("odc-ckpt", "truncated");
        let step = save(&dir, &map(), &state(), &serde_json::Value::Null).unwrap();
        for file in [MODEL_FILE, OPTIMIZER_FILE] {
            let path = step.join(file);
            let bytes = std::fs::read(&path).unwrap();
            std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
            let err = load(&step, &map()).unwrap_err().to_string();
            assert!(err.contains(file), "{err}");
            assert!(err.contains("truncated"), "{err}");
            std::fs::write(&path, &bytes).unwrap();
        }
        let json = step.join(STATE_FILE);
        let text = std::fs::read(&json).unwrap();
        std::fs::write(&json, &text[..text.len() / 2]).unwrap();
        let err = load(&step, &map()).unwrap_err().to_string();
        assert!(err.contains(STATE_FILE), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_models_checkpoint_is_refused() {
        let dir = temp_path("odc-ckpt", "other");
        let step = save(&dir, &map(), &state(), &serde_json::Value::Null).unwrap();
        let other = TensorMap::new(vec![
            vec![NamedTensor::new("embed.weight", &[2, 3])],
            vec![
                NamedTensor::new("layers.0.norm", &[2]),
                NamedTensor::new("layers.0.w", &[2, 2]),
            ],
        ])
        .unwrap();
        let err = load(&step, &other).unwrap_err().to_string();
        assert!(err.contains("embed.weight has shape [3, 2]"), "{err}");
        let renamed = TensorMap::flat(&[("a".into(), 6), ("b".into(), 6)]).unwrap();
        let err = load(&step, &renamed).unwrap_err().to_string();
        assert!(err.contains("not this model's"), "{err}");
        let missing = load(&dir.join("step-8"), &map()).unwrap_err().to_string();
        assert!(missing.contains("step-8"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn save_checks_lengths_and_replaces_a_step_atomically() {
        let dir = temp_path("odc-ckpt", "replace");
        let mut bad = state();
        bad.params[1].pop();
        assert!(matches!(
            save(&dir, &map(), &bad, &serde_json::Value::Null),
            Err(CheckpointError::Map(_))
        ));
        save(&dir, &map(), &state(), &serde_json::json!(1)).unwrap();
        let mut next = state();
        next.params[0][0] = 99.0;
        let step = save(&dir, &map(), &next, &serde_json::json!(2)).unwrap();
        let (loaded, extra) = load(&step, &map()).unwrap();
        assert_eq!((loaded.params[0][0], extra), (99.0, serde_json::json!(2)));
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("step-7")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
