//! Sampling a step's groups: `--group-size` responses to each prompt from the current policy,
//! each scored, and for a group that is trained on the reference's log-probabilities and the KL
//! to it.

use odc::model::{
    generate_group_with_log_probs, map_in_shares, sequence_log_probs, Sampling, Weights,
};
use odc::text::{exact_match, weighted_reward, Problem, TextFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// What sampling a step's groups needs.
pub(crate) struct Sampler<'a> {
    pub(crate) policy: &'a Weights,
    /// The reference whose log-probs a trained group needs (none when only scoring).
    pub(crate) reference: Option<&'a Weights>,
    pub(crate) format: &'a TextFormat,
    pub(crate) sampling: &'a Sampling,
    pub(crate) group_size: usize,
    pub(crate) seed: u64,
    pub(crate) format_weight: f64,
}

/// One sampled response (sent to every rank under `odc launch`).
#[derive(Serialize, Deserialize)]
pub(crate) struct Response {
    /// Prompt and response.
    pub(crate) tokens: Vec<u32>,
    pub(crate) response: Vec<u32>,
    pub(crate) reward: f64,
    pub(crate) correct: bool,
    /// The reference's log-probs of `tokens` (empty when the group is not trained on).
    pub(crate) ref_log_probs: Vec<f32>,
    /// The sum over the response's tokens of the k3 KL to the reference (0 when the group is not
    /// trained on).
    pub(crate) kl_sum: f64,
}

/// Each prompt's group of responses, sampled by `workers` threads at once (contiguous shares of
/// the prompts), a group decoded as one batch. Each response draws from its own RNG, seeded from
/// `seed` and the problem's index, so the responses do not depend on the number of workers.
pub(crate) fn sample_groups(
    sampler: &Sampler<'_>,
    prompts: &[(u64, Problem)],
    workers: usize,
) -> anyhow::Result<Vec<Vec<Response>>> {
    map_in_shares(prompts, workers, |(index, problem)| {
        sample_group(sampler, *index, problem)
    })
}

/// `group_size` responses to one problem, and the reference's log-probs and the KL to it when
/// their rewards differ (only such a group is trained on).
fn sample_group(s: &Sampler<'_>, index: u64, problem: &Problem) -> anyhow::Result<Vec<Response>> {
    let mut rng = StdRng::seed_from_u64(s.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut rngs: Vec<StdRng> = (0..s.group_size)
        .map(|_| StdRng::seed_from_u64(rng.random()))
        .collect();
    let prompt = s.format.prompt(&problem.question)?;
    let tokenizer = s.format.tokenizer();
    let mut group = Vec::with_capacity(s.group_size);
    let mut policy_log_probs = Vec::with_capacity(s.group_size);
    for generated in generate_group_with_log_probs(s.policy, &prompt, s.sampling, &mut rngs)? {
        let response = generated.tokens;
        let text = tokenizer.decode(&response)?;
        group.push(Response {
            tokens: prompt.iter().chain(&response).copied().collect(),
            reward: weighted_reward(&text, &problem.answer, s.format_weight),
            correct: exact_match(&text, &problem.answer),
            response,
            ref_log_probs: Vec::new(),
            kl_sum: 0.0,
        });
        policy_log_probs.push(generated.log_probs);
    }
    if let Some(reference) = s.reference {
        if group.iter().any(|r| r.reward != group[0].reward) {
            for (r, policy) in group.iter_mut().zip(&policy_log_probs) {
                r.ref_log_probs = sequence_log_probs(reference, &r.tokens)?;
                // The KL term the loss weighs, at the sampled tokens (the policy's log-probs
                // come from the decoder: no extra forward).
                let first = r.tokens.len() - r.response.len();
                r.kl_sum = r.ref_log_probs[first..]
                    .iter()
                    .zip(policy)
                    .map(|(&reference, &policy)| {
                        let d = f64::from(reference) - f64::from(policy);
                        d.exp() - d - 1.0
                    })
                    .sum();
            }
        }
    }
    Ok(group)
}
