//! Checkpoints from Python: the names a checkpoint gives each unit's tensors, where it is
//! written, and the one it resumes from — the recipes' own mechanisms ([`Resume`], the job's
//! sharded [`Job::save_checkpoint`]), none written again here.
//!
//! Guarantees (tested in `tests/test_checkpoint.py`):
//! - A checkpoint's tensors are named as the caller says (a model's parameter names and shapes,
//!   from `odc.torch`), else one flat tensor per unit named after it; names that do not tile a
//!   unit exactly are refused, naming the unit.
//! - Only the lead rank writes (the shard servers each write their own shards; the lead
//!   publishes); every rank may call, and the others are told `None`.
//! - `resume` is a `step-<N>` directory, which must open, or `"auto"`, the newest complete one of
//!   `checkpoint_dir` or none (then the job starts from scratch); the resumed job continues at
//!   step `N` with its optimizer state, and hands back the `extra` saved with it.

use std::path::{Path, PathBuf};

use odc::checkpoint::{Opened, TensorMap};
use odc::recipe::Resume;
use odc::Job;
use odc_policy::tensor_map::NamedTensor;
use pyo3::PyResult;

use crate::errors;

/// One unit's tensors as Python names them: (name, shape) in buffer order.
pub(crate) type UnitTensors = Vec<(String, Vec<usize>)>;

/// Where a job's checkpoints go and what they hold.
pub(crate) struct Checkpoints {
    pub tensors: TensorMap,
    pub dir: Option<PathBuf>,
    pub lead: bool,
}

/// The checkpoint a job resumed from: its directory, step and the caller's `extra` (JSON).
pub(crate) struct Resumed {
    pub path: PathBuf,
    pub step: u64,
    pub extra: String,
}

/// The checkpoint's names for `units` (name, length), from `tensors` where given.
pub(crate) fn tensor_map(
    units: &[(String, usize)],
    tensors: Option<Vec<UnitTensors>>,
) -> PyResult<TensorMap> {
    let Some(tensors) = tensors else {
        return TensorMap::flat(units).map_err(|e| errors::invalid(e.to_string()));
    };
    if tensors.len() != units.len() {
        return Err(errors::invalid(format!(
            "tensors names {} units' tensors for {} units",
            tensors.len(),
            units.len()
        )));
    }
    let mut named = Vec::with_capacity(units.len());
    for ((unit, len), list) in units.iter().zip(tensors) {
        let list: Vec<NamedTensor> = list
            .iter()
            .map(|(name, shape)| NamedTensor::new(name.clone(), shape))
            .collect();
        let total: usize = list.iter().map(NamedTensor::numel).sum();
        if total != *len {
            return Err(errors::invalid(format!(
                "unit {unit:?}: its tensors hold {total} elements, the unit {len}"
            )));
        }
        named.push(list);
    }
    TensorMap::new(named).map_err(|e| errors::invalid(e.to_string()))
}

/// The checkpoint `resume` names, opened against `map` (`None`: from scratch).
pub(crate) fn open(
    resume: Option<&str>,
    dir: Option<&Path>,
    map: &TensorMap,
    lead: bool,
) -> PyResult<Option<(Resumed, Opened)>> {
    let Some(resume) = resume else {
        return Ok(None);
    };
    let resume = Resume::parse(Path::new(resume));
    let root = match (&resume, dir) {
        (Resume::Newest, None) => {
            return Err(errors::invalid(
                "resume=\"auto\" looks in checkpoint_dir: give one".into(),
            ))
        }
        (_, dir) => dir.unwrap_or(Path::new(".")),
    };
    let opened = resume
        .open(root, map, lead)
        .map_err(|e| errors::checkpoint(e.to_string()))?;
    Ok(opened.map(|(path, opened)| {
        let resumed = Resumed {
            path,
            step: opened.step(),
            extra: opened.extra().to_string(),
        };
        (resumed, opened)
    }))
}

/// Writes the job's state at its current step into `checkpoint_dir/step-<N>` from the lead rank,
/// with `extra` (JSON text); the directory written, or `None` on the other ranks.
pub(crate) async fn save(
    job: &mut Job,
    checkpoints: &Checkpoints,
    extra: &serde_json::Value,
) -> odc::Result<Option<PathBuf>> {
    let Some(dir) = &checkpoints.dir else {
        return Err(odc::Error::Config(
            "save_checkpoint needs a checkpoint_dir (an option of init)".into(),
        ));
    };
    if !checkpoints.lead {
        return Ok(None);
    }
    let path = job
        .save_checkpoint(dir, &checkpoints.tensors, extra)
        .await?;
    Ok(Some(path))
}
