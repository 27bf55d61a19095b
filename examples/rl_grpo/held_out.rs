//! The held-out scores before and after RL: each rank scores its share of the problems, and
//! every rank gets the sums (the job's ranks in order).

use anyhow::Context;
use odc::Job;
use serde::{Deserialize, Serialize};

use crate::GATHER_TIMEOUT;

/// One rank's share of the held-out scores (summed over the ranks).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct HeldOutCounts {
    pub(crate) problems: u64,
    pub(crate) greedy_correct: u64,
    pub(crate) samples: u64,
    pub(crate) samples_correct: u64,
    pub(crate) reward_sum: f64,
}

/// The held-out scores before or after RL.
pub(crate) struct HeldOut {
    /// Exact match of greedy answers.
    pub(crate) greedy: f64,
    /// Mean reward and exact match of `--group-size` samples per problem at `--temperature`.
    pub(crate) reward: f64,
    pub(crate) accuracy: f64,
}

impl HeldOut {
    /// The scores as the run's log records them.
    pub(crate) fn figures(&self) -> [(&'static str, f64); 3] {
        [
            ("held_out_greedy_accuracy", self.greedy),
            ("held_out_reward", self.reward),
            ("held_out_accuracy", self.accuracy),
        ]
    }
}

/// Every rank's share of the held-out scores, summed (the job's ranks in order).
pub(crate) async fn sum(job: &mut Job, mine: HeldOutCounts) -> anyhow::Result<HeldOut> {
    let all = job
        .all_gather(&mine, GATHER_TIMEOUT)
        .await
        .context("gathering the held-out scores")?;
    let sum = |f: fn(&HeldOutCounts) -> f64| all.iter().map(f).sum::<f64>();
    let ratio = |a: f64, b: f64| a / b.max(1.0);
    Ok(HeldOut {
        greedy: ratio(sum(|c| c.greedy_correct as f64), sum(|c| c.problems as f64)),
        reward: ratio(sum(|c| c.reward_sum), sum(|c| c.samples as f64)),
        accuracy: ratio(sum(|c| c.samples_correct as f64), sum(|c| c.samples as f64)),
    })
}
