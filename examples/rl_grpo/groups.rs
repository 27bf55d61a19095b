//! A step's sampled groups as the trainers' samples: the responses store the trainers' compute
//! reads (by sample index), the groups whose rewards differ turned into samples with their
//! group-normalised advantages (DAPO's dynamic sampling: the others are not trained on), and the
//! step's statistics.

use std::collections::HashMap;
use std::sync::RwLock;

use odc::compute::SampleStore;
use odc::model::{group_advantages, RlSample, Sample};
use odc::SampleMeta;

use crate::names;
use crate::sampling::{self, Response};

/// The responses of the current step, by sample index (what the trainers' compute resolves).
#[derive(Default)]
pub(crate) struct Responses {
    pub(crate) map: RwLock<HashMap<u64, (Sample, RlSample)>>,
}

impl SampleStore for Responses {
    fn sample(&self, index: u64) -> Result<Sample, String> {
        let map = self
            .map
            .read()
            .map_err(|_| "response store poisoned".to_string())?;
        map.get(&index)
            .map(|(s, _)| s.clone())
            .ok_or_else(|| format!("no response {index} in this step"))
    }

    fn rl(&self, index: u64) -> Option<RlSample> {
        self.map.read().ok()?.get(&index).map(|(_, r)| r.clone())
    }
}

/// One step's sampled groups, as the trainers' samples (those of the groups whose rewards
/// differ) and as statistics.
#[derive(Default)]
pub(crate) struct StepSamples {
    pub(crate) store: HashMap<u64, (Sample, RlSample)>,
    pub(crate) metas: Vec<SampleMeta>,
    pub(crate) rewards: Vec<f64>,
    pub(crate) correct: usize,
    /// Each response's length in tokens.
    pub(crate) lengths: Vec<usize>,
    /// Groups sampled, and trained on.
    pub(crate) sampled: usize,
    pub(crate) kept: usize,
    /// KL summed over the trained groups' response tokens, and those tokens.
    pub(crate) kl_sum: f64,
    pub(crate) kl_tokens: usize,
}

impl StepSamples {
    /// The step's `groups`: every response in the statistics; a group whose responses all
    /// scored alike has zero advantages, nothing to learn but the KL term, so it is not trained
    /// on (DAPO's dynamic sampling, without refill). Sample indices start at `next_index`.
    pub(crate) fn of(groups: Vec<Vec<Response>>, next_index: &mut u64) -> Self {
        let mut s = StepSamples {
            sampled: groups.len(),
            ..StepSamples::default()
        };
        for group in groups {
            s.rewards.extend(group.iter().map(|r| r.reward));
            s.correct += group.iter().filter(|r| r.correct).count();
            s.lengths.extend(group.iter().map(|r| r.response.len()));
            if !sampling::trained(&group) {
                continue;
            }
            let rewards: Vec<f64> = group.iter().map(|r| r.reward).collect();
            s.kept += 1;
            s.kl_sum += group.iter().map(|r| r.kl_sum).sum::<f64>();
            s.kl_tokens += group.iter().map(|r| r.response.len()).sum::<usize>();
            for (r, advantage) in group.into_iter().zip(group_advantages(&rewards)) {
                let index = *next_index;
                *next_index += 1;
                s.metas.push(SampleMeta {
                    index,
                    tokens: r.tokens.len() as u64,
                    loss_tokens: r.response.len() as u64,
                });
                let mut loss_mask = vec![false; r.tokens.len()];
                loss_mask[r.tokens.len() - r.response.len()..].fill(true);
                let sample = Sample {
                    tokens: r.tokens,
                    loss_mask,
                };
                let rl = RlSample {
                    advantage: advantage as f32,
                    ref_log_probs: r.ref_log_probs,
                };
                s.store.insert(index, (sample, rl));
            }
        }
        s
    }

    /// Sets the step's metrics; the mean reward, the accuracy and the KL per trained response
    /// token (NaN when no group was trained on: nothing to measure it on).
    pub(crate) fn record(&self, sample_secs: f64) -> (f64, f64, f64) {
        let n = self.rewards.len() as f64;
        let reward = self.rewards.iter().sum::<f64>() / n;
        let accuracy = self.correct as f64 / n;
        let response_tokens = self.lengths.iter().sum::<usize>();
        let mean_len = response_tokens as f64 / self.lengths.len() as f64;
        let max_len = self.lengths.iter().copied().max().unwrap_or(0);
        let kl = self.kl_sum / self.kl_tokens as f64;
        metrics::gauge!(names::REWARD).set(reward);
        metrics::gauge!(names::ACCURACY).set(accuracy);
        metrics::gauge!(names::RESPONSE_TOKENS).set(mean_len);
        metrics::gauge!(names::RESPONSE_TOKENS_MAX).set(max_len as f64);
        metrics::gauge!(names::KL).set(kl);
        metrics::gauge!(names::SAMPLING_TOKENS_PER_SECOND)
            .set(response_tokens as f64 / sample_secs);
        metrics::counter!(names::GROUPS).increment(self.sampled as u64);
        metrics::counter!(names::GROUPS_TRAINED).increment(self.kept as u64);
        (reward, accuracy, kl)
    }
}
