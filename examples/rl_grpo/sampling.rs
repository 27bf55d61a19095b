//! Sampling a step's groups: `--group-size` responses to each prompt from the current policy,
//! each scored, and for a group that is trained on the reference's log-probabilities and the KL
//! to it.

use odc::model::{
    batch_log_probs, generate_batch_with_log_probs, map_batches_in_shares, Prompt, Sampling,
    Weights,
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
    /// Prompts decoded together (each with its group): one batched decode, and the reference's
    /// log-probs of its trained groups in one batched forward.
    pub(crate) batch: usize,
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
/// the batches of `sampler.batch` prompts), a batch decoded together. Each response draws from its
/// own RNG, seeded from `seed` and the problem's index, and the batches are cut from the whole
/// list, so the responses do not depend on the number of workers (nor of ranks, each sampling
/// a [`batch_share_range`](odc::model::batch_share_range)).
pub(crate) fn sample_groups(
    sampler: &Sampler<'_>,
    prompts: &[(u64, Problem)],
    workers: usize,
) -> anyhow::Result<Vec<Vec<Response>>> {
    map_batches_in_shares(prompts, workers, sampler.batch, |batch| {
        sample_batch(sampler, batch)
    })
}

/// `group_size` responses to each problem of `batch`, and the reference's log-probs and the KL to
/// it for the groups whose rewards differ (only such a group is trained on).
fn sample_batch(s: &Sampler<'_>, batch: &[(u64, Problem)]) -> anyhow::Result<Vec<Vec<Response>>> {
    let mut rngs: Vec<StdRng> = Vec::with_capacity(batch.len() * s.group_size);
    for (index, _) in batch {
        let mut rng = StdRng::seed_from_u64(s.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        rngs.extend((0..s.group_size).map(|_| StdRng::seed_from_u64(rng.random())));
    }
    let texts = batch
        .iter()
        .map(|(_, problem)| s.format.prompt(&problem.question))
        .collect::<Result<Vec<_>, _>>()?;
    let prompts: Vec<Prompt<'_>> = texts
        .iter()
        .map(|t| Prompt::new(t).samples(s.group_size))
        .collect();
    let generated = generate_batch_with_log_probs(s.policy, &prompts, s.sampling, &mut rngs)?;
    let tokenizer = s.format.tokenizer();
    let mut groups = Vec::with_capacity(batch.len());
    let mut policy_log_probs = Vec::with_capacity(generated.len());
    let mut generated = generated.into_iter();
    for ((_, problem), prompt) in batch.iter().zip(&texts) {
        let mut group = Vec::with_capacity(s.group_size);
        for g in generated.by_ref().take(s.group_size) {
            let text = tokenizer.decode(&g.tokens)?;
            group.push(Response {
                tokens: prompt.iter().chain(&g.tokens).copied().collect(),
                reward: weighted_reward(&text, &problem.answer, s.format_weight),
                correct: exact_match(&text, &problem.answer),
                response: g.tokens,
                ref_log_probs: Vec::new(),
                kl_sum: 0.0,
            });
            policy_log_probs.push(g.log_probs);
        }
        groups.push(group);
    }
    if let Some(reference) = s.reference {
        score_against(reference, &mut groups, &policy_log_probs)?;
    }
    Ok(groups)
}

/// The reference's log-probs of every response of the groups whose rewards differ (one batched
/// forward of them all), and each one's KL to it at the sampled tokens (`policy`: the decoder's
/// log-probs of every response, group-major: no extra forward of the policy).
fn score_against(
    reference: &Weights,
    groups: &mut [Vec<Response>],
    policy: &[Vec<f32>],
) -> anyhow::Result<()> {
    let trained = |g: &Vec<Response>| g.iter().any(|r| r.reward != g[0].reward);
    let sequences: Vec<&[u32]> = groups
        .iter()
        .filter(|g| trained(g))
        .flatten()
        .map(|r| r.tokens.as_slice())
        .collect();
    let mut scored = batch_log_probs(reference, &sequences)?.into_iter();
    let mut policy = policy.iter();
    for group in groups.iter_mut() {
        let kept = trained(group);
        for r in group.iter_mut() {
            let policy = policy.next().map(Vec::as_slice).unwrap_or_default();
            if !kept {
                continue;
            }
            r.ref_log_probs = scored.next().unwrap_or_default();
            // The KL term the loss weighs, at the sampled tokens.
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
    Ok(())
}
