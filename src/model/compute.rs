//! The model on odc: its units as a [`ModelLayout`](crate::ModelLayout) and a [`Compute`] that runs
//! one packed micro-batch against a [`TrainerContext`].
//!
//! One micro-batch ([`TransformerCompute`]):
//! 1. **forward, unit by unit**: `gather(u)` (prefetching `u + 1`), the unit's parameters become
//!    candle `Var`s, the unit runs on a *detached* copy of the previous unit's output, and the
//!    context's buffer is released (`release(u)`, I5: at most `prefetch + 1` gathered buffers);
//! 2. **backward, from the head down**: each unit's backward is a vector–Jacobian product on its own
//!    graph — `loss_sum` for the head, `sum(output ⊙ grad_output)` below it — giving the gradients
//!    of its parameters, pushed at once (`push_grad(u)`, in flight while the units below run their
//!    backward), and of its input, which is the next unit's `grad_output`; the unit's graph (and
//!    with it its copy of the weights) is dropped right after.
//!
//! Loss convention ([`odc::batch`](crate::MicroBatch)): the compute returns and differentiates the
//! **sum** of the targets' cross-entropies; the servers divide by the minibatch's loss tokens.
//! So any split of a minibatch over trainers gives the same update as one candle model on the whole
//! minibatch (I3; `tests/model_on_odc.rs` checks it against candle alone).
//!
//! Memory: each unit's graph keeps a copy of its weights until its backward ran (as FSDP with
//! `reshard_after_forward=False`); the gathered transfer buffers themselves are released after
//! each unit's forward.

use std::sync::Arc;

use candle_core::{Device, Tensor, Var};

use super::batch::{PackedBatch, Sample};
use super::config::ModelConfig;
use super::grpo::{grpo_loss_sum, rl_targets, GrpoConfig, RlSample};
use super::params::{as_tensors, unit_vars, ParamSpec};
use super::transformer::{
    head_log_probs, unit_count, unit_forward, unit_init_values, unit_params, HeadOutput, UnitOutput,
};
use crate::checkpoint::{NamedTensor, TensorMap};
use crate::{Compute, ComputeOutput, LossWeighting, MicroBatch, TrainerContext, UnitSpec};

/// Resolves a [`SampleMeta::index`](crate::SampleMeta) of a micro-batch to its tokens (and, for
/// GRPO, its advantage and reference log-probs).
pub trait SampleStore: Send + Sync + 'static {
    fn sample(&self, index: u64) -> Result<Sample, String>;

    /// The sample's RL data ([`Objective::Grpo`] needs it for every sample).
    fn rl(&self, index: u64) -> Option<RlSample> {
        let _ = index;
        None
    }
}

/// What the head differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Objective {
    /// Next-token cross-entropy summed over the targets (SFT).
    #[default]
    CrossEntropy,
    /// GRPO's clipped policy gradient plus KL to the reference, summed over response tokens
    /// ([`super::grpo`]); the loss reported is that sum.
    Grpo(GrpoConfig),
}

impl<F> SampleStore for F
where
    F: Fn(u64) -> Result<Sample, String> + Send + Sync + 'static,
{
    fn sample(&self, index: u64) -> Result<Sample, String> {
        self(index)
    }
}

/// The model's units for [`JobBuilder::units`](crate::JobBuilder::units): `embed`,
/// `layers.<l>`, `head`, each initialised by [`unit_init_values`].
pub fn layout_units(config: &ModelConfig) -> super::Result<Vec<UnitSpec>> {
    (0..unit_count(config))
        .map(|u| {
            Ok(UnitSpec::with_values(
                unit_name(config, u),
                unit_init_values(config, u)?,
            ))
        })
        .collect()
}

/// [`transformer_job`]'s fill floor of a micro-batch, as a fraction of the token budget.
pub const MICRO_BATCH_MIN_FILL: f64 = 0.5;

/// A [`JobBuilder`](crate::JobBuilder) with the model's units (starting from `init`, one flat
/// buffer per unit, or the seeded initialisation) and a [`TransformerCompute`] of `objective` on
/// the CPU per trainer; the caller adds trainers, servers, optimizer and data.
///
/// Dynamic dispatch fills micro-batches to at least half the token budget
/// ([`MICRO_BATCH_MIN_FILL`]; `JobBuilder::micro_batch_min_fill` overrides it): each micro-batch
/// is a pass over every unit (a gather, a forward and a backward of each), which on a small model
/// costs about as much as the last few samples guided packing would put alone.
pub fn transformer_job(
    config: &ModelConfig,
    init: Option<Vec<Vec<f32>>>,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
) -> super::Result<crate::JobBuilder> {
    let prototype =
        TransformerCompute::new(config.clone(), Device::Cpu, samples)?.with_objective(objective);
    let units = match init {
        None => layout_units(config)?,
        Some(values) => {
            if values.len() != unit_count(config) {
                return Err(super::Error::UnitParams {
                    what: "units",
                    expected: unit_count(config),
                    got: values.len(),
                });
            }
            values
                .into_iter()
                .enumerate()
                .map(|(u, v)| UnitSpec::with_values(unit_name(config, u), v))
                .collect()
        }
    };
    Ok(crate::Job::builder()
        .units(units)
        .micro_batch_min_fill(MICRO_BATCH_MIN_FILL)
        .compute(move |_trainer| Box::new(prototype.clone()) as Box<dyn Compute>))
}

/// The name of unit `u` in the layout.
pub fn unit_name(config: &ModelConfig, u: usize) -> String {
    match u {
        0 => "embed".into(),
        u if u <= config.n_layers => format!("layers.{}", u - 1),
        _ => "head".into(),
    }
}

/// The model's parameter names and shapes per unit: the checkpoint's tensor names.
pub fn tensor_map(config: &ModelConfig) -> super::Result<TensorMap> {
    let units = (0..unit_count(config))
        .map(|u| {
            Ok(unit_params(config, u)?
                .into_iter()
                .map(|p| NamedTensor::new(p.name, &p.shape))
                .collect())
        })
        .collect::<super::Result<Vec<_>>>()?;
    TensorMap::new(units).map_err(|e| super::Error::Batch(e.to_string()))
}

/// The [`Compute`] of the model (see the [module docs](self)).
#[derive(Clone)]
pub struct TransformerCompute {
    config: ModelConfig,
    specs: Vec<Vec<ParamSpec>>,
    device: Device,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
}

impl TransformerCompute {
    pub fn new(
        config: ModelConfig,
        device: Device,
        samples: Arc<dyn SampleStore>,
    ) -> super::Result<Self> {
        config.validate()?;
        let specs = (0..unit_count(&config))
            .map(|u| unit_params(&config, u))
            .collect::<super::Result<Vec<_>>>()?;
        Ok(TransformerCompute {
            config,
            specs,
            device,
            samples,
            objective: Objective::CrossEntropy,
        })
    }

    /// The same compute differentiating `objective`.
    pub fn with_objective(mut self, objective: Objective) -> Self {
        self.objective = objective;
        self
    }
}

/// One unit's forward kept for its backward.
struct Forward {
    params: Vec<Var>,
    input: Option<Var>,
    output: UnitOutput,
}

fn user(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::User {
        message: e.to_string(),
    }
}

#[async_trait::async_trait]
impl Compute for TransformerCompute {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> crate::Result<ComputeOutput> {
        let units = self.specs.len();
        if mb.weighting != LossWeighting::Tokens {
            return Err(crate::Error::Config(
                "the transformer's loss is a token sum: use LossWeighting::Tokens".into(),
            ));
        }
        let samples = mb
            .samples
            .iter()
            .map(|s| {
                let sample = self
                    .samples
                    .sample(s.index)
                    .map_err(|e| crate::Error::User {
                        message: format!("sample {}: {e}", s.index),
                    })?;
                if sample.tokens.len() as u64 != s.tokens {
                    return Err(crate::Error::User {
                        message: format!(
                            "sample {} has {} tokens, the balancer was told {}",
                            s.index,
                            sample.tokens.len(),
                            s.tokens
                        ),
                    });
                }
                Ok(sample)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let batch = PackedBatch::pack(&self.config, &samples, &self.device).map_err(user)?;
        let rl = match self.objective {
            Objective::CrossEntropy => None,
            Objective::Grpo(config) => {
                let rl = mb
                    .samples
                    .iter()
                    .map(|s| {
                        self.samples.rl(s.index).ok_or_else(|| crate::Error::User {
                            message: format!("sample {} has no advantage (GRPO)", s.index),
                        })
                    })
                    .collect::<crate::Result<Vec<_>>>()?;
                let (adv, reference) = rl_targets(&samples, &rl, &self.device).map_err(user)?;
                Some((config, adv, reference))
            }
        };

        let mut forwards: Vec<Forward> = Vec::with_capacity(units);
        let mut hidden: Option<Tensor> = None;
        for (u, specs) in self.specs.iter().enumerate() {
            let values = ctx.gather(u as u32).await?;
            let params = unit_vars(&values, specs, &self.device).map_err(user)?;
            drop(values);
            ctx.release(u as u32)?;
            let input = match &hidden {
                None => None,
                Some(h) => Some(Var::from_tensor(&h.detach()).map_err(user)?),
            };
            let tensors = as_tensors(&params);
            let output = match (&rl, &input) {
                (Some((config, adv, reference)), Some(x)) if u == units - 1 => {
                    let (logits, log_probs) =
                        head_log_probs(&self.config, &tensors, x.as_tensor(), &batch)
                            .map_err(user)?;
                    let loss_sum =
                        grpo_loss_sum(&log_probs, adv, reference, &batch.target_weights, *config)
                            .map_err(user)?;
                    UnitOutput::Head(HeadOutput {
                        logits,
                        loss: loss_sum.clone(),
                        loss_sum,
                    })
                }
                _ => unit_forward(
                    &self.config,
                    u,
                    &tensors,
                    input.as_ref().map(Var::as_tensor),
                    &batch,
                )
                .map_err(user)?,
            };
            if let UnitOutput::Hidden(h) = &output {
                hidden = Some(h.clone());
            }
            forwards.push(Forward {
                params,
                input,
                output,
            });
        }

        let mut loss_sum = 0.0;
        let mut grad_output: Option<Tensor> = None;
        for u in (0..units).rev() {
            let Forward {
                params,
                input,
                output,
            } = forwards
                .pop()
                .ok_or_else(|| user("a unit's forward is missing"))?;
            let root = match (&output, &grad_output) {
                (UnitOutput::Head(head), _) => {
                    loss_sum = head.loss_sum.to_scalar::<f32>().map_err(user)? as f64;
                    head.loss_sum.clone()
                }
                (UnitOutput::Hidden(out), Some(g)) => {
                    (out * g).map_err(user)?.sum_all().map_err(user)?
                }
                (UnitOutput::Hidden(_), None) => {
                    return Err(user(format!("unit {u} has no output gradient")))
                }
            };
            let grads = root.backward().map_err(user)?;
            let mut flat = Vec::with_capacity(self.specs[u].iter().map(ParamSpec::numel).sum());
            for (var, spec) in params.iter().zip(&self.specs[u]) {
                match grads.get(var.as_tensor()) {
                    Some(g) => flat.extend(
                        g.flatten_all()
                            .map_err(user)?
                            .to_vec1::<f32>()
                            .map_err(user)?,
                    ),
                    None => flat.extend(std::iter::repeat_n(0.0, spec.numel())),
                }
            }
            ctx.push_grad(u as u32, &flat)?;
            grad_output = match &input {
                Some(var) => grads.get(var.as_tensor()).cloned(),
                None => None,
            };
        }
        Ok(ComputeOutput { loss_sum })
    }
}
