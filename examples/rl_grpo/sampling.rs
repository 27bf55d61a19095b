//! Sampling a step's groups in three timed stages (verl's `timing_s/gen`, `reward`, `ref`):
//! `--group-size` responses to each prompt from the current policy (batches of `--decode-batch`
//! prompts, each decoded together), each response scored ([`sample_groups`]), and for a group
//! that is trained on the reference's log-probabilities and the KL to it (the trained responses
//! of each decoding batch in one batched forward, [`Sampled::against_reference`]) — once the
//! decoding is over, so that the policy, its cache and the reference are never held together.

use std::time::Instant;

use odc::model::{
    batch_log_probs, generate_batch_with_log_probs, map_in_shares, Generated, Prompt, Sampling,
    Weights,
};
use odc::recipe::{RewardCommand, RewardInput};
use odc::text::{exact_match, weighted_reward, Problem, TextFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// What sampling a step's groups needs.
pub(crate) struct Sampler<'a> {
    pub(crate) policy: &'a Weights,
    pub(crate) format: &'a TextFormat,
    pub(crate) sampling: &'a Sampling,
    pub(crate) group_size: usize,
    /// Prompts decoded together (each with its group): one batched decode, and the reference's
    /// log-probs of its trained groups in one batched forward.
    pub(crate) batch: usize,
    pub(crate) seed: u64,
    pub(crate) reward: &'a Reward,
}

/// How a response is rewarded.
pub(crate) enum Reward {
    /// The built-in GSM8K reward: 1 for the right final number, plus `format_weight` for the
    /// `#### n` format (`odc::text::weighted_reward`).
    Gsm8k { format_weight: f64 },
    /// The user's `--reward-command`, one run per decoding batch.
    Command(RewardCommand),
}

impl Reward {
    /// The rewards of `texts`, the completions of `problems` (one per text, in order).
    fn score(&self, problems: &[&Problem], texts: &[String]) -> anyhow::Result<Vec<f64>> {
        match self {
            Reward::Gsm8k { format_weight } => Ok(problems
                .iter()
                .zip(texts)
                .map(|(p, text)| weighted_reward(text, &p.answer, *format_weight))
                .collect()),
            Reward::Command(command) => {
                let inputs: Vec<RewardInput<'_>> = problems
                    .iter()
                    .zip(texts)
                    .map(|(p, text)| RewardInput {
                        prompt: &p.question,
                        completion: text,
                        answer: &p.answer,
                    })
                    .collect();
                Ok(command.score(&inputs)?)
            }
        }
    }
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

/// Whether a group is trained on: its rewards differ (a group that scored alike has zero
/// advantages, nothing to learn but the KL term: DAPO's dynamic sampling, without refill).
pub(crate) fn trained(group: &[Response]) -> bool {
    group.iter().any(|r| r.reward != group[0].reward)
}

/// A step's sampled and scored groups, before the reference's stage.
pub(crate) struct Sampled {
    batches: Vec<Scored>,
    pub(crate) timings: Timings,
}

/// Wall seconds of each sampling stage on this rank.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timings {
    /// Decoding the responses.
    pub(crate) gen: f64,
    /// Decoding their text and scoring it.
    pub(crate) reward: f64,
    /// The reference's log-probs of the trained groups.
    pub(crate) reference: f64,
}

/// A batch's groups of scored responses, and the decoder's log-probs of each response
/// (group-major).
type Scored = (Vec<Vec<Response>>, Vec<Vec<f32>>);

/// One decoding batch: its prompts' tokens and every response (prompt-major).
struct Decoded {
    prompts: Vec<Vec<u32>>,
    generated: Vec<Generated>,
}

/// Each prompt's group of responses, sampled by `workers` threads at once (contiguous shares of
/// the batches of `sampler.batch` prompts), a batch decoded together, with each stage's time.
/// Each response draws from its own RNG, seeded from `seed` and the problem's index, and the
/// batches are cut from the whole list, so the responses do not depend on the number of workers
/// (nor of ranks, each sampling a [`batch_share_range`](odc::model::batch_share_range)).
pub(crate) fn sample_groups(
    s: &Sampler<'_>,
    prompts: &[(u64, Problem)],
    workers: usize,
) -> anyhow::Result<Sampled> {
    let batches: Vec<&[(u64, Problem)]> = prompts.chunks(s.batch.max(1)).collect();
    let t = Instant::now();
    let decoded = map_in_shares(&batches, workers, |batch| decode(s, batch))?;
    let gen = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut scored = Vec::with_capacity(batches.len());
    for (batch, decoded) in batches.iter().zip(decoded) {
        scored.push(score(s, batch, decoded)?);
    }
    Ok(Sampled {
        batches: scored,
        timings: Timings {
            gen,
            reward: t.elapsed().as_secs_f64(),
            reference: 0.0,
        },
    })
}

impl Sampled {
    /// Each trained group's reference log-probs and KL to it, `workers` batches at once.
    pub(crate) fn against_reference(
        &mut self,
        reference: &Weights,
        workers: usize,
    ) -> anyhow::Result<()> {
        let kl = map_in_shares(&self.batches, workers, |(groups, policy)| {
            against_reference(reference, groups, policy)
        })?;
        for ((groups, _), kl) in self.batches.iter_mut().zip(kl) {
            for (r, (ref_log_probs, kl_sum)) in groups.iter_mut().flatten().zip(kl) {
                (r.ref_log_probs, r.kl_sum) = (ref_log_probs, kl_sum);
            }
        }
        Ok(())
    }

    /// Whether any group is trained on (needs the reference's stage).
    pub(crate) fn trains_any(&self) -> bool {
        self.batches
            .iter()
            .flat_map(|(groups, _)| groups)
            .any(|g| trained(g))
    }

    /// The groups, in prompt order.
    pub(crate) fn groups(self) -> Vec<Vec<Response>> {
        self.batches
            .into_iter()
            .flat_map(|(groups, _)| groups)
            .collect()
    }
}

/// `group_size` responses to each problem of `batch`, decoded together.
fn decode(s: &Sampler<'_>, batch: &[(u64, Problem)]) -> anyhow::Result<Decoded> {
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
    Ok(Decoded {
        prompts: texts,
        generated,
    })
}

/// A batch's responses as groups, each response's text scored (the batch's texts in one call of
/// the reward); and the decoder's log-probs of each (group-major).
fn score(s: &Sampler<'_>, batch: &[(u64, Problem)], decoded: Decoded) -> anyhow::Result<Scored> {
    let tokenizer = s.format.tokenizer();
    let texts = decoded
        .generated
        .iter()
        .map(|g| tokenizer.decode(&g.tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let problems: Vec<&Problem> = batch
        .iter()
        .flat_map(|(_, p)| std::iter::repeat_n(p, s.group_size))
        .collect();
    let rewards = s.reward.score(&problems, &texts)?;
    let mut groups = Vec::with_capacity(batch.len());
    let mut policy_log_probs = Vec::with_capacity(decoded.generated.len());
    let mut scored = decoded.generated.into_iter().zip(texts).zip(rewards);
    for ((_, problem), prompt) in batch.iter().zip(&decoded.prompts) {
        let mut group = Vec::with_capacity(s.group_size);
        for ((g, text), reward) in scored.by_ref().take(s.group_size) {
            group.push(Response {
                tokens: prompt.iter().chain(&g.tokens).copied().collect(),
                reward,
                correct: exact_match(&text, &problem.answer),
                response: g.tokens,
                ref_log_probs: Vec::new(),
                kl_sum: 0.0,
            });
            policy_log_probs.push(g.log_probs);
        }
        groups.push(group);
    }
    Ok((groups, policy_log_probs))
}

/// Per response of `groups` (group-major), the reference's log-probs and the KL to it at the
/// sampled tokens, for the groups whose rewards differ (one batched forward of them all; empty
/// and 0 for the others). `policy`: the decoder's log-probs of every response (no extra
/// forward of the policy).
fn against_reference(
    reference: &Weights,
    groups: &[Vec<Response>],
    policy: &[Vec<f32>],
) -> anyhow::Result<Vec<(Vec<f32>, f64)>> {
    let sequences: Vec<&[u32]> = groups
        .iter()
        .filter(|g| trained(g))
        .flatten()
        .map(|r| r.tokens.as_slice())
        .collect();
    let mut scored = batch_log_probs(reference, &sequences)?.into_iter();
    let mut policy = policy.iter();
    let mut out = Vec::new();
    for group in groups {
        let kept = trained(group);
        for r in group {
            let policy = policy.next().map(Vec::as_slice).unwrap_or_default();
            if !kept {
                out.push((Vec::new(), 0.0));
                continue;
            }
            let ref_log_probs = scored.next().unwrap_or_default();
            let first = r.tokens.len() - r.response.len();
            let kl: f64 = ref_log_probs
                .get(first..)
                .unwrap_or_default()
                .iter()
                .zip(policy)
                .map(|(&reference, &policy)| {
                    let d = f64::from(reference) - f64::from(policy);
                    d.exp() - d - 1.0
                })
                .sum();
            out.push((ref_log_probs, kl));
        }
    }
    Ok(out)
}
