//! RL checkpoints. `--checkpoint-every N` writes the policy's parameters and AdamW state as `sft`
//! does (sharded, verified, written while training goes on: `Job::checkpoint_async`), with the
//! run's position beside them in `state.json`: the RL steps done, the next problem and sample
//! index, and each step's mean reward. `--resume auto|DIR` continues from one: the same prompts in
//! the same order, each response from the same generator (seeded by its problem), so a run killed
//! during a step and resumed ends as the uninterrupted one (`tests/multiprocess/grpo.rs`).
//!
//! - The reference (the starting weights the KL is measured against, and the held-out scores
//!   "before") is served by the job but not in the checkpoint (served units never are): it is
//!   re-read from `--init` or `--model-dir`, which checkpointing therefore requires.
//! - A step that trained nothing (every group scored alike) leaves the parameters at the last
//!   checkpoint's version, so none is written for it (its directory would be that step's); a
//!   resumed run replays it: the same prompts and draws, again nothing to train.

use std::path::Path;

use anyhow::{bail, Context};
use odc::checkpoint::{Opened, TensorMap};
use odc::recipe::{Process, Resume};
use serde::{Deserialize, Serialize};

use crate::args::Args;

/// Where the RL steps are: what a resumed run continues from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Position {
    /// RL steps done.
    pub(crate) steps_done: u64,
    /// The next problem of the training task to consider.
    pub(crate) problem: u64,
    /// The next response's sample index.
    pub(crate) next_index: u64,
    /// Each step's mean sampled reward (the report's trend), and the last step's accuracy.
    pub(crate) step_rewards: Vec<f64>,
    pub(crate) last_accuracy: Option<f64>,
}

/// `state.json`'s extra: the position and the settings a continuation must share.
#[derive(Serialize, Deserialize)]
struct Saved {
    rl: Position,
    seed: u64,
    prompts: usize,
    group_size: usize,
    max_value: u64,
}

/// A checkpoint to continue from: opened (mapped and verified; each shard server reads its
/// ranges), and its position.
pub(crate) struct Resumed {
    pub(crate) opened: Opened,
    pub(crate) position: Position,
}

/// Checkpointing needs a reference that can be read again (see the module docs).
pub(crate) fn check(args: &Args) -> anyhow::Result<()> {
    let checkpoints = args.checkpoint_every > 0 || args.resume.is_some();
    if checkpoints && args.init.is_none() && args.model_dir.is_none() {
        bail!(
            "--checkpoint-every and --resume need --init or --model-dir: the reference (the \
             starting weights) is read from there again when a run resumes"
        );
    }
    Ok(())
}

/// The checkpoint `--resume` names (`auto`: the newest complete one in `--checkpoint-dir`, none
/// there: from scratch, said on stderr by the lead), checked against this run's settings.
pub(crate) fn resume(
    args: &Args,
    tensors: &TensorMap,
    max_value: u64,
    process: &Process,
) -> anyhow::Result<Option<Resumed>> {
    let Some(resume) = args.resume.as_deref().map(|r| Resume::parse(Path::new(r))) else {
        return Ok(None);
    };
    let Some((dir, opened)) = resume.open(&args.checkpoint_dir, tensors, process.is_lead())? else {
        return Ok(None);
    };
    let saved: Saved = serde_json::from_value(opened.extra().clone()).with_context(|| {
        format!(
            "{}: state.json holds no rl_grpo position (an sft checkpoint is an --init)",
            dir.display()
        )
    })?;
    let mine = (args.seed, args.prompts, args.group_size, max_value);
    let theirs = (saved.seed, saved.prompts, saved.group_size, saved.max_value);
    if mine != theirs {
        bail!(
            "{}: the checkpoint's run had --seed {}, --prompts {}, --group-size {} and problems up \
             to {}; this one has {}, {}, {} and {}: it would not continue the same prompts",
            dir.display(),
            theirs.0,
            theirs.1,
            theirs.2,
            theirs.3,
            mine.0,
            mine.1,
            mine.2,
            mine.3
        );
    }
    process.say(format!(
        "resuming from {} after RL step {} (problem {})",
        dir.display(),
        saved.rl.steps_done,
        saved.rl.problem
    ));
    Ok(Some(Resumed {
        opened,
        position: saved.rl,
    }))
}

/// `state.json`'s extra for a checkpoint at `position`.
pub(crate) fn extra(
    args: &Args,
    max_value: u64,
    position: &Position,
) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::to_value(Saved {
        rl: position.clone(),
        seed: args.seed,
        prompts: args.prompts,
        group_size: args.group_size,
        max_value,
    })?)
}
