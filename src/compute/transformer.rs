//! The model on odc: its units as a [`ModelLayout`](crate::ModelLayout) and a [`Compute`] that runs
//! one packed micro-batch against a [`TrainerContext`].
//!
//! One micro-batch ([`TransformerCompute`]) walks the model's **stages** ([`stages`]): the
//! embedding, each block (with its LoRA adapter unit, when there is one), the head.
//! 1. **forward, stage by stage**: `gather(u)` of each of the stage's units (prefetching the
//!    next), their parameters become candle `Var`s, the stage runs on a *detached* copy of the
//!    previous stage's output, and the context's buffers are released (`release(u)`, I5: at most
//!    `prefetch + 1` gathered buffers); a frozen unit's tensors enter the graph as constants;
//! 2. **backward, from the head down**: each stage's backward is a vector–Jacobian product on its
//!    own graph — `loss_sum` for the head, `sum(output ⊙ grad_output)` below it — giving the
//!    gradients of its trainable units, pushed at once (`push_grad(u)`, in flight while the stages
//!    below run their backward), and of its input, which is the next stage's `grad_output`; the
//!    stage's graph (and with it its copy of the weights) is dropped right after. A frozen unit is
//!    never pushed ([`unit_trainable`]; under LoRA only the adapters train), and a stage with
//!    nothing to train and no input (a frozen embedding) has no backward.
//!
//! **Tied embeddings**: the head's forward reads unit 0's matrix as its LM head
//! ([`head_tensors`]); the head's backward gives that matrix a gradient, which is added to the
//! embedding lookup's, and unit 0 is pushed once, last.
//!
//! Loss convention ([`odc::batch`](crate::MicroBatch)): the compute returns and differentiates the
//! **sum** of the targets' cross-entropies; the servers divide by the minibatch's loss tokens.
//! So any split of a minibatch over trainers gives the same update as one candle model on the whole
//! minibatch (I3; `tests/model_on_odc.rs` checks it against candle alone).
//!
//! **Memory** ([`Reshard`], [`Placement::reshard`]): with `Reshard::Never` each stage's graph
//! keeps a copy of its weights until its backward ran (FSDP's `reshard_after_forward=False`): a
//! trainer ends its forward holding the whole model. Resharding runs a stage's forward without a
//! graph and keeps only its input (activation checkpointing at stage boundaries); the backward
//! re-gathers the stage (the context prefetches downwards from the first one,
//! [`TrainerContext::backward_from`]), recomputes its forward with a graph and runs its
//! vector–Jacobian product as above, so a trainer holds at most the stage being differentiated,
//! the prefetched one and one `tokens × d_model` input per stage. The last stages kept (at least
//! the head) skip the second pull, and so does the embedding: a lookup's backward is a
//! scatter-add of its output's gradient into the looked-up rows (plus a tied head's gradient),
//! which reads no weights, so the backward stops gathering at unit 1. Either way the gathered
//! transfer buffers are released as soon as a stage's tensors are made. A tied head takes unit
//! 0's matrix; the chunked head leaves its gradient in a sink ([`crate::model::head::WeightGrad`]), the
//! full head reads it through a `Var` of its own. Every stage's forward and backward runs in
//! [`odc_actors::trainer::blocking`], so that the prefetch and the pushes the context started move
//! while it computes (a long synchronous section would otherwise hold them on its worker).
//!
//! **On a CUDA device** ([`Placement`], [`crate::model::device`]): each trainer opens its own device
//! (own stream) at its first micro-batch; the forward and backward run there (in fp32 or bf16
//! mixed precision, [`ComputePrecision`]), and the loss is read back after the whole backward was
//! enqueued, so nothing waits for the device before the last gradient. How units and gradients
//! move is [`DeviceTransfers`]:
//! - **`Device`** (the default): the context gathers each unit straight into this trainer's
//!   device memory (`resident`: a buffer of the published dtype that becomes the unit's tensor
//!   as it is, cast to fp32 on the device), and each unit's gradient, concatenated on the
//!   device, is added into its owners' accumulators from there by the owner's kernel, when the
//!   data path reaches them (the `cuda` transport: a one-process job whose servers are on the
//!   same GPU, [`crate::JobBuilder::servers_on_device`], or `odc launch --transport cuda`, over
//!   CUDA IPC); a gradient is checked for non-finite values by its sum, read with the loss. On
//!   any other data path the trainer takes the host path below.
//! - **`Host`**: a gathered unit (host `f32`s) goes up in one host-to-device copy and each
//!   unit's gradient comes down in one device-to-host copy (the transport's accumulate payload
//!   is host fp32), pushed once the next unit's backward is enqueued (`staging`), with the
//!   servers of a one-process job in host memory.
//!
//! Bytes that crossed host memory are counted ([`super::host_staging`]).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};

use super::gang_link::TransportLink;
use crate::model::batch::{GangPiece, PackedBatch, Sample};
use crate::model::config::{HeadImpl, Implementations, ModelConfig};
use crate::model::device::{location_ordinal, open_device, ComputePrecision, DeviceSpec};
use crate::model::error::{Error, Result};
use crate::model::gang::GangLayout;
use crate::model::grpo::{grpo_loss_sum, rl_targets_with_pieces, GrpoConfig, RlSample};
use crate::model::head::WeightGrad;
use crate::model::params::{as_tensors, unit_tensors, unit_vars, ParamSpec};
use crate::model::reshard::Reshard;
use crate::model::transformer::{
    head_forward_with, head_target_log_probs_with, head_tensors, stages, unit_count, unit_forward,
    unit_params, unit_trainable, HeadOutput, UnitOutput,
};
use crate::{
    blocking, Compute, ComputeOutput, LossWeighting, MicroBatch, SpanKind, TrainerContext,
};
use odc_actors::batch::Piece;
use odc_actors::policy::step::DEFAULT_MICRO_BATCH_TIMEOUT;
use odc_actors::trainer::UnitValues;

/// Resolves a [`SampleMeta::index`](crate::SampleMeta) of a micro-batch to its tokens (and, for
/// GRPO, its advantage and reference log-probs).
pub trait SampleStore: Send + Sync + 'static {
    fn sample(&self, index: u64) -> std::result::Result<Sample, String>;

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
    /// ([`crate::model::grpo`]); the loss reported is that sum.
    Grpo(GrpoConfig),
}

impl<F> SampleStore for F
where
    F: Fn(u64) -> std::result::Result<Sample, String> + Send + Sync + 'static,
{
    fn sample(&self, index: u64) -> std::result::Result<Sample, String> {
        self(index)
    }
}

/// Where and how a [`TransformerCompute`] runs: the device, the precision of its matmuls and
/// activations, the process's local rank (`ODC_LOCAL_RANK`; `cuda` without an ordinal is device
/// `local_rank mod device_count`), and what it keeps of a unit between its forward and its
/// backward ([`Reshard`]). The default is the CPU in fp32, resharding by the model's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placement {
    pub device: DeviceSpec,
    pub precision: ComputePrecision,
    pub local_rank: u32,
    pub reshard: Reshard,
    /// The attention and head implementations (the memory-lean ones by default).
    pub implementations: Implementations,
    /// How units and gradients move between a GPU trainer and the servers.
    pub transfers: DeviceTransfers,
}

/// How a trainer on a CUDA device moves parameters and gradients (the CPU ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceTransfers {
    /// Device to device wherever the transport reaches the servers' device memory (one process
    /// on one GPU, whose servers are on that GPU too); through host staging elsewhere.
    #[default]
    Device,
    /// Always through host memory (pinned staging), with the servers in host memory in one
    /// process: the path before the device-resident one, kept for comparison.
    Host,
}

/// The [`Compute`] of the model (see the [module docs](self)).
#[derive(Clone)]
pub struct TransformerCompute {
    config: ModelConfig,
    pub(super) specs: Vec<Vec<ParamSpec>>,
    placement: Placement,
    /// Given ([`TransformerCompute::new`]) or opened at the first micro-batch.
    device: Option<Device>,
    samples: Arc<dyn SampleStore>,
    objective: Objective,
    /// How long a gang member waits for a peer's exchange (I6).
    gang_timeout: Duration,
    #[cfg(feature = "cuda")]
    transfers: Transfers,
}

/// A trainer's pinned staging on a CUDA device, made at its first micro-batch (a clone starts
/// without: each trainer has its own).
#[cfg(feature = "cuda")]
#[derive(Default)]
struct Transfers {
    staging: Option<super::staging::Staging>,
    /// The context was given this trainer's device memory for its gathers.
    memory_given: bool,
    /// Gradients are pushed from device memory (this micro-batch).
    from_device: bool,
    /// Per gradient pushed from device memory: its sum, read with the loss (a non-finite one
    /// fails the micro-batch).
    checks: Vec<(usize, Tensor)>,
}

#[cfg(feature = "cuda")]
impl Clone for Transfers {
    fn clone(&self) -> Self {
        Transfers::default()
    }
}

impl TransformerCompute {
    /// On `device` (CPU, or a CUDA device opened with [`open_device`]), in fp32.
    pub fn new(config: ModelConfig, device: Device, samples: Arc<dyn SampleStore>) -> Result<Self> {
        let spec = match &device {
            Device::Cpu => DeviceSpec::Cpu,
            other => DeviceSpec::Cuda(Some(location_ordinal(other))),
        };
        let mut compute = Self::on(
            config,
            Placement {
                device: spec,
                ..Placement::default()
            },
            samples,
        )?;
        compute.device = Some(device);
        Ok(compute)
    }

    /// On `placement`: the device is opened at the first micro-batch, by each clone for itself.
    pub fn on(
        config: ModelConfig,
        placement: Placement,
        samples: Arc<dyn SampleStore>,
    ) -> Result<Self> {
        config.validate()?;
        let specs = (0..unit_count(&config))
            .map(|u| unit_params(&config, u))
            .collect::<Result<Vec<_>>>()?;
        Ok(TransformerCompute {
            config,
            specs,
            placement,
            device: matches!(placement.device, DeviceSpec::Cpu).then_some(Device::Cpu),
            samples,
            objective: Objective::CrossEntropy,
            gang_timeout: DEFAULT_MICRO_BATCH_TIMEOUT,
            #[cfg(feature = "cuda")]
            transfers: Transfers::default(),
        })
    }

    /// The same compute with gang members waiting at most `timeout` for a peer's exchange.
    pub fn with_gang_timeout(mut self, timeout: Duration) -> Self {
        self.gang_timeout = timeout;
        self
    }

    /// The same compute differentiating `objective`.
    pub fn with_objective(mut self, objective: Objective) -> Self {
        self.objective = objective;
        self
    }

    /// The same compute with its matmuls and activations in `precision`.
    pub fn with_precision(mut self, precision: ComputePrecision) -> Self {
        self.placement.precision = precision;
        self
    }

    /// The compute's device, opened now if it was not yet.
    fn device(&mut self) -> Result<Device> {
        if let Some(device) = &self.device {
            return Ok(device.clone());
        }
        let device = open_device(self.placement.device, self.placement.local_rank)?;
        self.device = Some(device.clone());
        Ok(device)
    }

    /// Unit `u`'s gathered values on `device` as the forward's tensors and, when `trainable`,
    /// the `Var`s they are (a frozen unit's tensors are plain constants: no `Var`, no
    /// gradient). On the CPU one tensor per parameter; on a CUDA device the whole unit as one
    /// flat tensor (gathered into device memory, or uploaded once from the host), split on the
    /// device.
    fn unit_params(
        &mut self,
        u: usize,
        values: &UnitValues,
        trainable: bool,
        device: &Device,
    ) -> Result<(Vec<Tensor>, Option<Vec<Var>>)> {
        match (device, values) {
            #[cfg(feature = "cuda")]
            (Device::Cuda(_), _) => {
                let flat = match values {
                    UnitValues::Host(values) => self.staging(device)?.upload(values)?,
                    UnitValues::Device { .. } => {
                        super::resident::flat_tensor(values)?.to_dtype(DType::F32)?
                    }
                };
                self.split_flat(u, &flat, trainable)
            }
            (_, UnitValues::Host(values)) if trainable => {
                let vars = unit_vars(values, &self.specs[u], device)?;
                Ok((as_tensors(&vars), Some(vars)))
            }
            (_, UnitValues::Host(values)) => {
                Ok((unit_tensors(values, &self.specs[u], device)?, None))
            }
            (_, UnitValues::Device { .. }) => Err(Error::Device(format!(
                "unit {u} was gathered into device memory, the compute runs on {device:?}"
            ))),
        }
    }

    /// Unit `u`'s parameters cut from its flat tensor on the device: `Var`s (copies) when
    /// `trainable`, else copies as constants (the flat buffer is the transfer's).
    #[cfg(feature = "cuda")]
    fn split_flat(
        &self,
        u: usize,
        flat: &Tensor,
        trainable: bool,
    ) -> Result<(Vec<Tensor>, Option<Vec<Var>>)> {
        let (mut tensors, mut vars) = (Vec::new(), Vec::new());
        for t in crate::model::params::unit_views(flat, &self.specs[u])? {
            if trainable {
                let var = Var::from_tensor(&t)?;
                tensors.push(var.as_tensor().clone());
                vars.push(var);
            } else {
                tensors.push(t.copy()?);
            }
        }
        Ok((tensors, trainable.then_some(vars)))
    }

    /// This trainer's staging on `device`, made at first use (slots of the largest unit).
    #[cfg(feature = "cuda")]
    fn staging(&mut self, device: &Device) -> Result<&mut super::staging::Staging> {
        if self.transfers.staging.is_none() {
            let largest = self
                .specs
                .iter()
                .map(|s| s.iter().map(ParamSpec::numel).sum::<usize>())
                .max()
                .unwrap_or(0);
            self.transfers.staging = Some(super::staging::Staging::new(device, largest)?);
        }
        self.transfers
            .staging
            .as_mut()
            .ok_or_else(|| Error::Device("cuda staging is missing".into()))
    }

    /// Unit `u`'s gradient, one flat fp32 buffer in parameter order (zeros for a parameter the
    /// loss does not reach): on the CPU the values; on a CUDA device a download in flight.
    /// `tied` is the head's gradient of the embedding (tied embeddings), added to the first
    /// parameter's: the embedding unit's gradient sums both uses and is pushed once. The
    /// gradients are taken by value and each is dropped once copied, so at most one parameter's
    /// gradient exists twice (a unit-sized one: the embedding's is `vocab × d_model`).
    fn unit_grad(
        &mut self,
        u: usize,
        grads: Vec<Option<Tensor>>,
        mut tied: Option<Tensor>,
        device: &Device,
    ) -> Result<UnitGrad> {
        let mut combined = grads.into_iter().enumerate().map(|(i, g)| {
            let t = if i == 0 { tied.take() } else { None };
            Ok::<_, candle_core::Error>(match (g, t) {
                (Some(g), Some(t)) => Some((g.to_dtype(DType::F32)? + t.to_dtype(DType::F32)?)?),
                (Some(g), None) | (None, Some(g)) => Some(g),
                (None, None) => None,
            })
        });
        let specs = &self.specs[u];
        if device.is_cpu() {
            let mut flat: Vec<f32> = Vec::new();
            for spec in specs {
                let values = match combined.next().transpose()?.flatten() {
                    Some(g) => g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    None => vec![0.0; spec.numel()],
                };
                if flat.is_empty() {
                    // The first (for the embedding, the only) parameter: no second copy.
                    flat = values;
                    flat.reserve_exact(
                        specs.iter().map(ParamSpec::numel).sum::<usize>() - flat.len(),
                    );
                } else {
                    flat.extend_from_slice(&values);
                }
            }
            return Ok(UnitGrad::Host(flat));
        }
        let parts = specs
            .iter()
            .map(|spec| match combined.next().transpose()?.flatten() {
                Some(g) => g.to_dtype(DType::F32)?.flatten_all(),
                None => Tensor::zeros(spec.numel(), DType::F32, device),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = Tensor::cat(&parts, 0)?;
        #[cfg(feature = "cuda")]
        if self.transfers.from_device {
            return Ok(UnitGrad::Resident(flat));
        }
        self.download(flat)
    }

    #[cfg(feature = "cuda")]
    fn download(&mut self, flat: Tensor) -> Result<UnitGrad> {
        let device = flat.device().clone();
        Ok(UnitGrad::Device(self.staging(&device)?.download(flat)?))
    }

    #[cfg(not(feature = "cuda"))]
    fn download(&mut self, flat: Tensor) -> Result<UnitGrad> {
        Ok(UnitGrad::Host(flat.to_vec1::<f32>()?))
    }

    /// The gathered values of a stage's units, in the stage's order; gathered in reverse order
    /// in the backward (so the context's prefetch, which then runs downwards, finds the next).
    async fn gather_stage(
        &mut self,
        ctx: &mut TrainerContext,
        stage: &[usize],
        reverse: bool,
    ) -> crate::Result<Vec<UnitValues>> {
        let mut values: Vec<Option<UnitValues>> = vec![None; stage.len()];
        let order: Vec<usize> = if reverse {
            (0..stage.len()).rev().collect()
        } else {
            (0..stage.len()).collect()
        };
        for i in order {
            values[i] = Some(ctx.gather_values(stage[i] as u32).await?);
        }
        Ok(values.into_iter().flatten().collect())
    }

    /// A stage's forward on `input` (none for the embedding) from its units' gathered `values`
    /// (handed back to the context here: released once they are tensors). With `graph`, a
    /// trainable unit's tensors are `Var`s and the input is a `Var`, so the backward can run;
    /// without, nothing is recorded (a resharded stage's forward). The embedding stage leaves
    /// unit 0's matrix in `embedding` for a tied head, which gets a `Var` of its own.
    #[allow(clippy::too_many_arguments)]
    fn stage_forward(
        &mut self,
        stage: &[usize],
        values: Vec<UnitValues>,
        graph: bool,
        input: Option<&Tensor>,
        embedding: &mut Option<Tensor>,
        batch: &PackedBatch,
        rl: &RlInputs,
    ) -> Result<StageGraph> {
        let device = self.device()?;
        let head = self.specs.len() - 1;
        let first = stage[0];
        let mut tensors = Vec::new();
        let mut units = Vec::with_capacity(stage.len());
        for (&u, values) in stage.iter().zip(values) {
            let trainable = graph && unit_trainable(&self.config, u)?;
            // A frozen unit's tensors are constants of the graph: no gradient is computed for
            // them (the backward still flows through them to the input).
            let (params, vars) = self.unit_params(u, &values, trainable, &device)?;
            drop(values);
            if u == 0 && self.config.tie_embeddings {
                *embedding = params.first().map(Tensor::detach);
            }
            tensors.extend(self.placement.precision.cast(&params)?);
            units.push((u, vars));
        }
        let input_var = match input {
            Some(x) if graph => Some(Var::from_tensor(x)?),
            _ => None,
        };
        let x = match &input_var {
            Some(var) => Some(var.as_tensor().clone()),
            None => input.cloned(),
        };
        let mut tied = None;
        if first == head && self.config.tie_embeddings {
            // Taken: nothing reads the matrix after the head (the embedding's backward is a
            // scatter-add of rows, or its own kept graph), and a Var is a copy of it.
            let matrix = embedding
                .take()
                .ok_or_else(|| Error::Batch("no embedding unit before the head".into()))?;
            let matrix = match graph && unit_trainable(&self.config, 0)? {
                // The chunked head leaves the matrix's gradient in a sink: no Var copy, no
                // accumulation in candle's store.
                true if batch.implementations.head == HeadImpl::Chunked => {
                    tied = Some(TiedGrad::Sink(WeightGrad::default()));
                    matrix
                }
                true => {
                    let var = Var::from_tensor(&matrix)?;
                    drop(matrix);
                    let t = var.as_tensor().clone();
                    tied = Some(TiedGrad::Store(var));
                    t
                }
                false => matrix,
            };
            let cast = self
                .placement
                .precision
                .cast(std::slice::from_ref(&matrix))?;
            tensors = head_tensors(&self.config, &tensors, &cast[0]);
        }
        let sink = match &tied {
            Some(TiedGrad::Sink(sink)) => Some(sink),
            _ => None,
        };
        let output = match (rl, &x) {
            (Some((config, adv, reference)), Some(x)) if first == head => {
                let log_probs = head_target_log_probs_with(&self.config, &tensors, x, batch, sink)?;
                let loss_sum =
                    grpo_loss_sum(&log_probs, adv, reference, &batch.target_weights, *config)?;
                UnitOutput::Head(HeadOutput {
                    logits: None,
                    loss: loss_sum.clone(),
                    loss_sum,
                })
            }
            (None, Some(x)) if first == head && sink.is_some() => {
                UnitOutput::Head(head_forward_with(&self.config, &tensors, x, batch, sink)?)
            }
            _ => unit_forward(&self.config, first, &tensors, x.as_ref(), batch)?,
        };
        Ok(StageGraph {
            units,
            input: input_var,
            tied,
            output,
        })
    }

    /// Pushes a gradient whose download completed (or waits for it first).
    fn push(&mut self, ctx: &mut TrainerContext, u: usize, grad: UnitGrad) -> crate::Result<()> {
        match grad {
            UnitGrad::Host(flat) => {
                ctx.push_grad(u as u32, &flat)?;
            }
            #[cfg(feature = "cuda")]
            UnitGrad::Resident(flat) => {
                let check = flat.sum_all().map_err(user)?;
                self.transfers.checks.push((u, check));
                let grad = super::resident::Grad::new(flat).map_err(user)?;
                ctx.push_grad_device(u as u32, Arc::new(grad))?;
            }
            #[cfg(feature = "cuda")]
            UnitGrad::Device(download) => {
                let device = self.device().map_err(user)?;
                let flat = self
                    .staging(&device)
                    .map_err(user)?
                    .finish(download)
                    .map_err(user)?;
                ctx.push_grad(u as u32, flat)?;
            }
        }
        Ok(())
    }
}

/// A unit's gradient on its way to the push.
enum UnitGrad {
    Host(Vec<f32>),
    /// Pushed from device memory as it is (flat fp32).
    #[cfg(feature = "cuda")]
    Resident(Tensor),
    #[cfg(feature = "cuda")]
    Device(super::staging::Download),
}

impl UnitGrad {
    /// Whether the values are still on their way from the device (pushed later).
    fn in_flight(&self) -> bool {
        match self {
            UnitGrad::Host(_) => false,
            #[cfg(feature = "cuda")]
            UnitGrad::Resident(_) => false,
            #[cfg(feature = "cuda")]
            UnitGrad::Device(_) => true,
        }
    }
}

/// A stage's forward with its graph, for its backward: its units (index, and the `Var`s of a
/// trainable one), the input as a `Var` (none for the embedding), the head's own `Var` of the
/// tied embedding matrix, and the output.
struct StageGraph {
    units: Vec<(usize, Option<Vec<Var>>)>,
    input: Option<Var>,
    tied: Option<TiedGrad>,
    output: UnitOutput,
}

/// Where a tied head's gradient of the embedding matrix is after the head's backward.
enum TiedGrad {
    /// In candle's store, under this `Var` (a copy of the matrix; the full head).
    Store(Var),
    /// In the chunked head's sink, the matrix a constant of the graph.
    Sink(WeightGrad),
}

/// What the forward leaves for a stage's backward: its graph, or (resharded) only its input.
enum Forward {
    Kept(StageGraph),
    Resharded { input: Option<Tensor> },
}

/// The context's buffers of a stage's units, once they are tensors (I5).
fn release(ctx: &mut TrainerContext, stage: &[usize]) -> crate::Result<()> {
    for &u in stage {
        ctx.release(u as u32)?;
    }
    Ok(())
}

fn user(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::User {
        message: e.to_string(),
    }
}

#[async_trait::async_trait]
impl Compute for TransformerCompute {
    /// One micro-batch: its inputs, the forward stage by stage, then the backward from the head
    /// down, pushing each unit's gradient as soon as it is known (see the [module docs](self)).
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> crate::Result<ComputeOutput> {
        let device = self.device().map_err(user)?;
        if mb.weighting != LossWeighting::Tokens {
            return Err(crate::Error::Config(
                "the transformer's loss is a token sum: use LossWeighting::Tokens".into(),
            ));
        }
        #[cfg(feature = "cuda")]
        self.begin_transfers(ctx, &device)?;
        let samples = self.samples_of(mb)?;
        let mut batch = if mb.pieces.is_empty() {
            PackedBatch::pack(&self.config, &samples, &device).map_err(user)?
        } else {
            self.pack_with_pieces(ctx, &samples, &mb.pieces, &device)?
        };
        batch.implementations = self.placement.implementations;
        let rl = self.rl_inputs(mb, &samples, &batch, &device)?;
        let stages = stages(&self.config);
        // Unit 0's matrix (fp32, no graph): the LM head too when the embeddings are tied.
        let mut embedding: Option<Tensor> = None;
        let forwards = self
            .forward(ctx, &stages, &batch, &rl, &mut embedding)
            .await?;
        let loss_sum = self
            .backward(ctx, &stages, forwards, &batch, &rl, &mut embedding, &device)
            .await?;
        Ok(ComputeOutput { loss_sum })
    }
}

/// GRPO's inputs of a micro-batch: the objective's config, each target's advantage and its
/// reference log-probability (`None` for SFT).
type RlInputs = Option<(GrpoConfig, Tensor, Tensor)>;

/// What the backward carries from one stage down to the next.
#[derive(Default)]
struct Backward {
    /// The head's loss (detached: it must not keep the head's graph alive).
    loss: Option<Tensor>,
    /// The gradient of the output of the stage below.
    grad_output: Option<Tensor>,
    /// Tied embeddings: the head's gradient of the embedding, added to unit 0's.
    tied: Option<Tensor>,
    /// A device gradient is pushed once the next unit's backward is enqueued (overlap).
    pending: Option<(usize, UnitGrad)>,
}

#[cfg(feature = "cuda")]
impl TransformerCompute {
    /// A micro-batch's start on `device`: on a CUDA device whose transfers stay there
    /// ([`DeviceTransfers::Device`]), the context gathers into this trainer's device memory and
    /// gradients are pushed from it, when the data path can.
    fn begin_transfers(&mut self, ctx: &mut TrainerContext, device: &Device) -> crate::Result<()> {
        self.transfers.checks.clear();
        self.transfers.from_device = false;
        if !device.is_cuda() || self.placement.transfers != DeviceTransfers::Device {
            return Ok(());
        }
        if !self.transfers.memory_given {
            let memory = super::resident::Memory::new(device).map_err(user)?;
            ctx.gather_into_device(Arc::new(memory));
            self.transfers.memory_given = true;
        }
        self.transfers.from_device = ctx.pushes_from_device();
        Ok(())
    }

    /// The sums of the gradients pushed from device memory, read in one copy: a non-finite one
    /// fails the micro-batch, naming the unit (its servers' barrier refuses the step anyway).
    fn check_device_grads(&mut self, ctx: &mut TrainerContext) -> crate::Result<()> {
        let checks = std::mem::take(&mut self.transfers.checks);
        if checks.is_empty() {
            return Ok(());
        }
        let sums: Vec<Tensor> = checks.iter().map(|(_, t)| t.clone()).collect();
        let values = Tensor::stack(&sums, 0)
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(user)?;
        match checks.iter().zip(values).find(|(_, v)| !v.is_finite()) {
            Some(((u, _), v)) => Err(ctx.non_finite_gradient(*u as u32, None, v)),
            None => Ok(()),
        }
    }
}

impl TransformerCompute {
    /// The micro-batch's samples, each checked against the length the balancer was told.
    fn samples_of(&self, mb: &MicroBatch) -> crate::Result<Vec<Sample>> {
        mb.samples
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
            .collect()
    }

    /// GRPO's advantages and reference log-probabilities at the pack's targets (a gang member's
    /// piece: its sample's at the piece's positions); `None` for SFT.
    fn rl_inputs(
        &self,
        mb: &MicroBatch,
        samples: &[Sample],
        batch: &PackedBatch,
        device: &Device,
    ) -> crate::Result<RlInputs> {
        let Objective::Grpo(config) = self.objective else {
            return Ok(None);
        };
        let rl_of = |index: u64| {
            self.samples.rl(index).ok_or_else(|| crate::Error::User {
                message: format!("sample {index} has no advantage (GRPO)"),
            })
        };
        let rl = mb
            .samples
            .iter()
            .map(|s| rl_of(s.index))
            .collect::<crate::Result<Vec<_>>>()?;
        let pieces = mb
            .pieces
            .iter()
            .zip(&batch.pieces)
            .map(|(p, packed)| Ok((rl_of(p.sample.index)?, packed.layout.positions())))
            .collect::<crate::Result<Vec<_>>>()?;
        let pieces: Vec<_> = pieces.iter().map(|(d, p)| (d, p.as_slice())).collect();
        let (adv, reference) =
            rl_targets_with_pieces(samples, &rl, &pieces, device).map_err(user)?;
        Ok(Some((config, adv, reference)))
    }

    /// Gathers `stage` (in reverse order for a backward's re-gather) and runs its forward, with
    /// its graph when `graph`, off the worker so that the prefetch of the next unit moves while
    /// it computes; the gathered buffers are released once they are tensors (I5).
    #[allow(clippy::too_many_arguments)]
    async fn run_stage(
        &mut self,
        ctx: &mut TrainerContext,
        stage: &[usize],
        regather: bool,
        graph: bool,
        input: Option<&Tensor>,
        embedding: &mut Option<Tensor>,
        batch: &PackedBatch,
        rl: &RlInputs,
    ) -> crate::Result<StageGraph> {
        let values = self.gather_stage(ctx, stage, regather).await?;
        let started = ctx.now();
        let out =
            blocking(|| self.stage_forward(stage, values, graph, input, embedding, batch, rl))
                .map_err(user)?;
        ctx.record_span(SpanKind::Compute, started, ctx.now());
        release(ctx, stage)?;
        Ok(out)
    }

    /// The forward, stage by stage: each stage on a detached copy of the previous one's output;
    /// a stage keeps its graph, or (resharded) only its input.
    async fn forward(
        &mut self,
        ctx: &mut TrainerContext,
        stages: &[Vec<usize>],
        batch: &PackedBatch,
        rl: &RlInputs,
        embedding: &mut Option<Tensor>,
    ) -> crate::Result<Vec<Forward>> {
        let reshard = self.placement.reshard.resolve(&self.config).map_err(user)?;
        let mut forwards: Vec<Forward> = Vec::with_capacity(stages.len());
        let mut hidden: Option<Tensor> = None;
        for (s, stage) in stages.iter().enumerate() {
            // The previous stage's output, cut from its graph: each stage has its own.
            let input = hidden.take().map(|h| h.detach());
            let keep = reshard.keeps(s, stages.len());
            let graph = self
                .run_stage(
                    ctx,
                    stage,
                    false,
                    keep,
                    input.as_ref(),
                    embedding,
                    batch,
                    rl,
                )
                .await?;
            if let UnitOutput::Hidden(h) = &graph.output {
                hidden = Some(h.clone());
            }
            forwards.push(if keep {
                Forward::Kept(graph)
            } else {
                // Released: the weights and the graph go; the input is the checkpoint.
                Forward::Resharded { input }
            });
        }
        Ok(forwards)
    }

    /// The backward, from the head down: each stage's vector–Jacobian product on its own graph
    /// (a resharded stage re-gathered and recomputed first), each unit's gradient pushed at once.
    /// Returns the loss.
    #[allow(clippy::too_many_arguments)]
    async fn backward(
        &mut self,
        ctx: &mut TrainerContext,
        stages: &[Vec<usize>],
        mut forwards: Vec<Forward>,
        batch: &PackedBatch,
        rl: &RlInputs,
        embedding: &mut Option<Tensor>,
        device: &Device,
    ) -> crate::Result<f64> {
        // Re-gathers come in reverse order, from the last resharded stage's last unit down:
        // prefetch it while the kept stages' backward runs.
        let first_regather = forwards
            .iter()
            .rposition(|f| matches!(f, Forward::Resharded { .. }))
            .and_then(|s| stages[s].last());
        // The embedding is never gathered again: resharded, its backward is a scatter-add of
        // the output gradient into its rows (see below), which reads no weights.
        if let Some(&unit) = first_regather {
            ctx.backward_from(unit as u32, 1);
        }
        let mut state = Backward::default();
        while let Some(forward) = forwards.pop() {
            let stage = &stages[forwards.len()];
            let trains = stage
                .iter()
                .map(|&u| unit_trainable(&self.config, u))
                .collect::<Result<Vec<bool>>>()
                .map_err(user)?;
            let graph = match forward {
                Forward::Kept(graph) => graph,
                // A stage with nothing to train and no input to pass a gradient to (a frozen
                // embedding) has no backward: not even a re-gather.
                Forward::Resharded { input: None } if !trains.iter().any(|&t| t) => continue,
                Forward::Resharded { input: None } if stage == &[0] => {
                    self.embedding_backward(ctx, batch, &mut state, device)?;
                    continue;
                }
                Forward::Resharded { input } => {
                    self.run_stage(ctx, stage, true, true, input.as_ref(), embedding, batch, rl)
                        .await?
                }
            };
            self.stage_backward(ctx, stage[0], graph, &mut state, device)?;
        }
        if let Some((unit, grad)) = state.pending.take() {
            self.push(ctx, unit, grad)?;
        }
        #[cfg(feature = "cuda")]
        self.check_device_grads(ctx)?;
        match state.loss {
            Some(l) => Ok(l
                .to_dtype(DType::F32)
                .map_err(user)?
                .to_scalar::<f32>()
                .map_err(user)? as f64),
            None => Err(user("the model has no head unit")),
        }
    }

    /// The embedding's lookup resharded: `d embed = scatter-add of the output gradient into the
    /// looked-up rows` (plus the tied head's gradient), no re-gather, no graph.
    fn embedding_backward(
        &mut self,
        ctx: &mut TrainerContext,
        batch: &PackedBatch,
        state: &mut Backward,
        device: &Device,
    ) -> crate::Result<()> {
        let g = state
            .grad_output
            .take()
            .ok_or_else(|| user("the embedding has no output gradient"))?;
        let grad =
            embedding_grad(&self.config, batch, &g, state.tied.take(), device).map_err(user)?;
        drop(g);
        let grad = self
            .unit_grad(0, vec![Some(grad)], None, device)
            .map_err(user)?;
        if let Some((unit, earlier)) = state.pending.take() {
            self.push(ctx, unit, earlier)?;
        }
        self.push(ctx, 0, grad)
    }

    /// One stage's vector–Jacobian product on its graph (whose first unit is `first`):
    /// `loss_sum` for the head, `sum(output ⊙ grad_output)` below it. Gives the gradients of its
    /// trainable units, pushed (a device one once the next is enqueued), and of its input, the
    /// next stage's `grad_output`.
    fn stage_backward(
        &mut self,
        ctx: &mut TrainerContext,
        first: usize,
        graph: StageGraph,
        state: &mut Backward,
        device: &Device,
    ) -> crate::Result<()> {
        let StageGraph {
            units: gathered,
            input,
            tied: tied_var,
            output,
        } = graph;
        let root = match (&output, &state.grad_output) {
            (UnitOutput::Head(head), _) => {
                state.loss = Some(head.loss_sum.detach());
                head.loss_sum.clone()
            }
            (UnitOutput::Hidden(out), Some(g)) => {
                (out * g).map_err(user)?.sum_all().map_err(user)?
            }
            (UnitOutput::Hidden(_), None) => {
                return Err(user(format!("unit {first} has no output gradient")))
            }
        };
        if input.is_none() && gathered.iter().all(|(_, vars)| vars.is_none()) {
            return Ok(());
        }
        // Off the worker: the re-gather of the next stage and the pushes move meanwhile.
        let started = ctx.now();
        let mut grads = blocking(|| root.backward()).map_err(user)?;
        ctx.record_span(SpanKind::Compute, started, ctx.now());
        // The stage's graph (its activations) goes now, before its gradients are copied.
        drop((root, output));
        // Each gradient is taken out detached: candle's accumulated gradients are tensors of
        // the graph of their computation (the zero accumulator, each partial gradient and the
        // sums), which a gradient that kept its op would keep alive.
        let mut take = |var: &Var| grads.remove(var.as_tensor()).map(|g| g.detach());
        if let Some(t) = tied_var {
            state.tied = match t {
                TiedGrad::Store(var) => take(&var),
                TiedGrad::Sink(sink) => sink.take(),
            };
        }
        state.grad_output = input.and_then(|var| take(&var));
        let taken: Vec<(usize, Option<Vec<Option<Tensor>>>)> = gathered
            .into_iter()
            .map(|(u, vars)| (u, vars.map(|params| params.iter().map(&mut take).collect())))
            .collect();
        // The rest (the gradients of tensors that lead to no variable) goes with the store.
        drop(grads);
        for (u, unit_grads) in taken {
            let Some(unit_grads) = unit_grads else {
                continue;
            };
            let tied_here = if u == 0 { state.tied.take() } else { None };
            let grad = self
                .unit_grad(u, unit_grads, tied_here, device)
                .map_err(user)?;
            if !grad.in_flight() {
                self.push(ctx, u, grad)?;
            } else if let Some((unit, earlier)) = state.pending.replace((u, grad)) {
                self.push(ctx, unit, earlier)?;
            }
        }
        Ok(())
    }
}

impl TransformerCompute {
    /// The pack of a gang member: its whole `samples`, then its pieces of split samples in order
    /// (each resolved whole, its end of the gang from this process's registry).
    fn pack_with_pieces(
        &self,
        ctx: &TrainerContext,
        samples: &[Sample],
        pieces: &[Piece],
        device: &Device,
    ) -> crate::Result<PackedBatch> {
        // Every trainer of a job that splits has its gang channel (its inbox on the transport).
        let channel = ctx.gang().ok_or_else(|| {
            crate::Error::Config(format!(
                "trainer {} got a piece of a split sample but has no gang channel: a job splits \
                 samples only through JobBuilder::sequence_parallel or context parallelism",
                ctx.trainer()
            ))
        })?;
        let mut wholes = Vec::with_capacity(pieces.len());
        let mut gangs = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let index = piece.sample.index;
            let whole = self.samples.sample(index).map_err(|e| crate::Error::User {
                message: format!("sample {index}: {e}"),
            })?;
            if whole.tokens.len() as u64 != piece.sample.tokens {
                return Err(crate::Error::User {
                    message: format!(
                        "sample {index} has {} tokens, the balancer was told {}",
                        whole.tokens.len(),
                        piece.sample.tokens
                    ),
                });
            }
            let layout = GangLayout::zigzag(
                whole.tokens.len(),
                piece.members as usize,
                piece.member as usize,
            )
            .map_err(user)?;
            let link = TransportLink::new(
                channel.clone(),
                piece.epoch,
                piece.gang,
                piece.member as usize,
                piece.ranks.clone(),
                self.gang_timeout,
                device.clone(),
            )
            .map_err(user)?;
            wholes.push(whole);
            gangs.push(GangPiece::new(layout, Arc::new(link)));
        }
        let pieces = wholes.iter().zip(gangs).collect();
        PackedBatch::pack_with_pieces(&self.config, samples, pieces, device).map_err(user)
    }
}

/// The embedding matrix's gradient `[vocab, d_model]` (fp32) from its output's gradient
/// `g: [T, d_model]`: each token's row gets its position's gradient (`index_select`'s backward),
/// added to the tied head's gradient of the same matrix when there is one.
fn embedding_grad(
    config: &ModelConfig,
    batch: &PackedBatch,
    g: &Tensor,
    tied: Option<Tensor>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let base = match tied {
        Some(t) => t.to_dtype(DType::F32)?,
        None => Tensor::zeros((config.vocab_size, config.d_model), DType::F32, device)?,
    };
    base.index_add(&batch.tokens, &g.to_dtype(DType::F32)?, 0)
}
