//! A real model for the runtime tests: a 3-unit tanh network (D → H → H → 1) regressing a fixed
//! teacher, trained on sequences of variable length (every token carries a squared-error loss).
//! Gradients are computed for real, layer by layer, against the trainer context; the same math runs
//! in a plain single-process reference loop (no actors) for the I3 equivalence tests, also with
//! units held fixed (frozen units).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc::transport::{codec, Dtype};
use odc::{
    async_trait, Compute, ComputeOutput, MicroBatch, OptimizerConfig, SampleMeta, TrainerContext,
    UnitSpec,
};

pub const D: usize = 6;
pub const H: usize = 8;

/// Deterministic uniform value in [-1, 1) from a key (splitmix64).
pub fn uniform(key: u64) -> f32 {
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The model's units with their initial values, the units of `frozen` frozen.
pub fn units_frozen(frozen: &[u32]) -> Vec<UnitSpec> {
    units()
        .into_iter()
        .enumerate()
        .map(|(u, spec)| {
            if frozen.contains(&(u as u32)) {
                spec.frozen()
            } else {
                spec
            }
        })
        .collect()
}

/// The model's units with their initial values.
pub fn units() -> Vec<UnitSpec> {
    let init = |seed: u64, len: usize, fan_in: usize| -> Vec<f32> {
        let s = 1.0 / (fan_in as f32).sqrt();
        (0..len)
            .map(|i| uniform(seed * 1_000_003 + i as u64) * s)
            .collect()
    };
    vec![
        UnitSpec::with_values("layer0", init(1, H * D + H, D)),
        UnitSpec::with_values("layer1", init(2, H * H + H, H)),
        UnitSpec::with_values("head", init(3, H + 1, H)),
    ]
}

/// Token `pos` of sample `index`: features and target.
pub fn token(index: u64, pos: u64) -> ([f32; D], f32) {
    let mut x = [0f32; D];
    for (k, v) in x.iter_mut().enumerate() {
        *v = uniform(
            index
                .wrapping_mul(7919)
                .wrapping_add(pos * 31 + k as u64 + 17),
        );
    }
    let teacher: f32 = x
        .iter()
        .enumerate()
        .map(|(k, v)| v * (k as f32 - 2.5) * 0.4)
        .sum();
    (x, teacher.tanh())
}

/// `n` minibatches of `size` samples with lengths 1..=max_len (variable), reproducible by `seed`.
pub fn minibatches(seed: u64, steps: usize, size: usize, max_len: u64) -> Vec<Vec<SampleMeta>> {
    (0..steps)
        .map(|s| {
            (0..size)
                .map(|i| {
                    let index = seed * 100_000 + (s * size + i) as u64;
                    let r = (uniform(index ^ 0xABCD) + 1.0) / 2.0;
                    let len = 1 + ((r * r * r) * (max_len - 1) as f32) as u64;
                    SampleMeta::new(index, len)
                })
                .collect()
        })
        .collect()
}

fn matvec(w: &[f32], b: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| b[r] + (0..cols).map(|c| w[r * cols + c] * x[c]).sum::<f32>())
        .collect()
}

/// Activations of one token kept for backward.
struct Tape {
    x: [f32; D],
    y: f32,
    h0: Vec<f32>,
    h1: Vec<f32>,
    out: f32,
}

/// Forward of layer 0 and 1 for every token.
fn forward_hidden(p0: &[f32], samples: &[SampleMeta]) -> Vec<Tape> {
    let mut tapes = Vec::new();
    for s in samples {
        for pos in 0..s.tokens {
            let (x, y) = token(s.index, pos);
            let h0: Vec<f32> = matvec(&p0[..H * D], &p0[H * D..], &x, H)
                .into_iter()
                .map(f32::tanh)
                .collect();
            tapes.push(Tape {
                x,
                y,
                h0,
                h1: Vec::new(),
                out: 0.0,
            });
        }
    }
    tapes
}

fn forward_layer1(p1: &[f32], tapes: &mut [Tape]) {
    for t in tapes {
        t.h1 = matvec(&p1[..H * H], &p1[H * H..], &t.h0, H)
            .into_iter()
            .map(f32::tanh)
            .collect();
    }
}

/// Head forward and backward: loss sum, head gradient, and d(loss)/d(a1) per token.
fn head(p2: &[f32], tapes: &mut [Tape]) -> (f64, Vec<f32>, Vec<Vec<f32>>) {
    let mut loss = 0f64;
    let mut g2 = vec![0f32; H + 1];
    let mut da1s = Vec::with_capacity(tapes.len());
    for t in tapes.iter_mut() {
        t.out = p2[H] + (0..H).map(|k| p2[k] * t.h1[k]).sum::<f32>();
        let dy = t.out - t.y;
        loss += 0.5 * (dy as f64) * (dy as f64);
        for (g, h) in g2.iter_mut().zip(&t.h1) {
            *g += dy * h;
        }
        g2[H] += dy;
        da1s.push(
            (0..H)
                .map(|k| dy * p2[k] * (1.0 - t.h1[k] * t.h1[k]))
                .collect(),
        );
    }
    (loss, g2, da1s)
}

/// Layer 1 backward: its gradient and d(loss)/d(a0) per token.
fn layer1_backward(p1: &[f32], tapes: &[Tape], da1s: &[Vec<f32>]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut g1 = vec![0f32; H * H + H];
    let mut da0s = Vec::with_capacity(tapes.len());
    for (t, da1) in tapes.iter().zip(da1s) {
        for r in 0..H {
            for c in 0..H {
                g1[r * H + c] += da1[r] * t.h0[c];
            }
            g1[H * H + r] += da1[r];
        }
        da0s.push(
            (0..H)
                .map(|c| {
                    let dh0: f32 = (0..H).map(|r| p1[r * H + c] * da1[r]).sum();
                    dh0 * (1.0 - t.h0[c] * t.h0[c])
                })
                .collect(),
        );
    }
    (g1, da0s)
}

fn layer0_backward(tapes: &[Tape], da0s: &[Vec<f32>]) -> Vec<f32> {
    let mut g0 = vec![0f32; H * D + H];
    for (t, da0) in tapes.iter().zip(da0s) {
        for r in 0..H {
            for c in 0..D {
                g0[r * D + c] += da0[r] * t.x[c];
            }
            g0[H * D + r] += da0[r];
        }
    }
    g0
}

/// Loss sum and gradients of the summed loss over `samples` with full parameters (reference).
pub fn loss_and_grads(params: &[Vec<f32>], samples: &[SampleMeta]) -> (f64, Vec<Vec<f32>>) {
    let mut tapes = forward_hidden(&params[0], samples);
    forward_layer1(&params[1], &mut tapes);
    let (loss, g2, da1s) = head(&params[2], &mut tapes);
    let (g1, da0s) = layer1_backward(&params[1], &tapes, &da1s);
    let g0 = layer0_backward(&tapes, &da0s);
    (loss, vec![g0, g1, g2])
}

/// Plain training loop, no actors: full-batch gradient of each minibatch, scaled by 1/tokens,
/// optionally clipped, then the optimizer. `pull` emulates the precision trainers compute with.
pub fn reference_train(
    minibatches: &[Vec<SampleMeta>],
    optimizer: OptimizerConfig,
    pull: Dtype,
    clip: Option<f64>,
) -> Vec<Vec<f32>> {
    reference_train_frozen(minibatches, optimizer, pull, clip, &[])
}

/// [`reference_train`] holding the units of `frozen` fixed: their gradients are computed (the
/// units below need them) but neither counted in the norm nor applied, and they take no
/// optimizer step (no weight decay).
pub fn reference_train_frozen(
    minibatches: &[Vec<SampleMeta>],
    optimizer: OptimizerConfig,
    pull: Dtype,
    clip: Option<f64>,
    frozen: &[u32],
) -> Vec<Vec<f32>> {
    let trains = |u: usize| !frozen.contains(&(u as u32));
    let mut params: Vec<Vec<f32>> = units()
        .into_iter()
        .map(|u| match u.init {
            odc::UnitInit::Values(v) => v.to_vec(),
            _ => unreachable!("test units have explicit values"),
        })
        .collect();
    let mut states: Vec<_> = params
        .iter()
        .map(|p| odc::OptimizerState::new(&optimizer, p.len()))
        .collect();
    for mb in minibatches {
        let seen: Vec<Vec<f32>> = params
            .iter()
            .map(|p| p.iter().map(|&v| codec::round_trip(pull, v)).collect())
            .collect();
        let (_, mut grads) = loss_and_grads(&seen, mb);
        for (u, g) in grads.iter_mut().enumerate() {
            if !trains(u) {
                g.clear();
            }
        }
        let weight: f64 = mb.iter().map(|s| s.loss_tokens as f64).sum();
        let mut sum_sq = 0f64;
        for g in grads.iter_mut().flatten() {
            *g = (*g as f64 * (1.0 / weight)) as f32;
            sum_sq += (*g as f64).powi(2);
        }
        let norm = sum_sq.sqrt();
        if let Some(max) = clip {
            if norm > max {
                let c = max / (norm + 1e-6);
                for g in grads.iter_mut().flatten() {
                    *g = (*g as f64 * c) as f32;
                }
            }
        }
        for (u, ((p, g), st)) in params.iter_mut().zip(&grads).zip(&mut states).enumerate() {
            if trains(u) {
                st.step(&optimizer, p, g).expect("lengths match");
            }
        }
    }
    params
}

/// What [`Hooks::poison`] makes non-finite in a micro-batch holding a poisoned sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Poison {
    /// Element `element` of unit `unit`'s gradient is NaN (the first such micro-batch only).
    GradNan { unit: u32, element: usize },
    /// The loss is NaN (the first such micro-batch only).
    LossNan,
    /// Element 0 of the head's gradient is `f32::MAX` in every such micro-batch: finite, so no
    /// trainer refuses it, but two of them overflow the fp32 sum to inf.
    GradMax,
}

/// Knobs the tests turn on one trainer's compute.
#[derive(Default)]
pub struct Hooks {
    /// Sleep this long before the first gather of every micro-batch on this trainer.
    pub delay: Option<(u32, Duration)>,
    /// Panic once, on this trainer, after pushing the head gradient, at this step.
    pub panic_at: Option<(u32, u64)>,
    pub panicked: AtomicBool,
    /// (step, first values of unit 0) as gathered by every micro-batch (I1).
    pub seen: Mutex<Vec<(u64, Vec<f32>)>>,
    /// Micro-batches run (all attempts).
    pub runs: AtomicUsize,
    /// Poison micro-batches holding a sample whose dataset index is in the range.
    pub poison: Option<(Poison, std::ops::Range<u64>)>,
    /// (trainer, micro-batch, sample indices) of every micro-batch poisoned.
    pub poisoned: Mutex<Vec<(u32, u32, Vec<u64>)>>,
    /// Push frozen units' gradients too (which `push_grad` refuses); otherwise the compute skips
    /// them, as a user's compute does.
    pub push_frozen: AtomicBool,
}

impl Hooks {
    /// The poison micro-batch `mb` on `trainer` gets, recorded in `poisoned`.
    fn poison_for(&self, trainer: u32, mb: &MicroBatch) -> Option<Poison> {
        let (poison, range) = self.poison.clone()?;
        if !mb.samples.iter().any(|s| range.contains(&s.index)) {
            return None;
        }
        let mut poisoned = self.poisoned.lock().unwrap();
        if poison != Poison::GradMax && !poisoned.is_empty() {
            return None;
        }
        let samples = mb.samples.iter().map(|s| s.index).collect();
        poisoned.push((trainer, mb.id, samples));
        Some(poison)
    }
}

/// `grad` of `unit` as `poison` leaves it.
fn poisoned(poison: Option<Poison>, unit: u32, mut grad: Vec<f32>) -> Vec<f32> {
    match poison {
        Some(Poison::GradNan { unit: u, element }) if u == unit => grad[element] = f32::NAN,
        Some(Poison::GradMax) if unit == 2 => grad[0] = f32::MAX,
        _ => {}
    }
    grad
}

/// The model as user compute: gathers layer by layer, releases what it no longer needs and pushes
/// each trainable unit's gradient as soon as its backward is done.
pub struct MlpCompute {
    pub trainer: u32,
    pub hooks: Arc<Hooks>,
}

impl MlpCompute {
    /// Push `grad` of `unit`, unless the unit is frozen (and [`Hooks::push_frozen`] is off).
    fn push(&self, ctx: &mut TrainerContext, unit: u32, grad: &[f32]) -> odc::Result<()> {
        let frozen = !ctx.layout().unit(unit)?.trainable;
        if !frozen || self.hooks.push_frozen.load(Ordering::SeqCst) {
            ctx.push_grad(unit, grad)?;
        }
        Ok(())
    }
}

#[async_trait]
impl Compute for MlpCompute {
    async fn run(
        &mut self,
        ctx: &mut TrainerContext,
        mb: &MicroBatch,
    ) -> odc::Result<ComputeOutput> {
        self.hooks.runs.fetch_add(1, Ordering::SeqCst);
        let poison = self.hooks.poison_for(self.trainer, mb);
        if let Some((t, d)) = self.hooks.delay {
            if t == self.trainer {
                tokio::time::sleep(d).await;
            }
        }
        let p0 = ctx.gather(0).await?;
        self.hooks
            .seen
            .lock()
            .unwrap()
            .push((mb.step, p0[..4].to_vec()));
        let mut tapes = forward_hidden(&p0, &mb.samples);
        ctx.release(0)?;
        let p1 = ctx.gather(1).await?;
        forward_layer1(&p1, &mut tapes);
        ctx.release(1)?;
        let p2 = ctx.gather(2).await?;
        ctx.backward();
        let (loss, g2, da1s) = head(&p2, &mut tapes);
        self.push(ctx, 2, &poisoned(poison, 2, g2))?;
        ctx.release(2)?;
        if let Some((t, step)) = self.hooks.panic_at {
            if t == self.trainer
                && step == mb.step
                && !self.hooks.panicked.swap(true, Ordering::SeqCst)
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
                panic!("injected failure of trainer {t} at step {step}");
            }
        }
        let p1 = ctx.gather(1).await?;
        let (g1, da0s) = layer1_backward(&p1, &tapes, &da1s);
        self.push(ctx, 1, &poisoned(poison, 1, g1))?;
        ctx.release(1)?;
        self.push(ctx, 0, &poisoned(poison, 0, layer0_backward(&tapes, &da0s)))?;
        let loss_sum = match poison {
            Some(Poison::LossNan) => f64::NAN,
            _ => loss,
        };
        Ok(ComputeOutput { loss_sum })
    }
}

/// A compute factory for [`MlpCompute`] sharing `hooks`.
pub fn factory(hooks: Arc<Hooks>) -> impl Fn(u32) -> Box<dyn Compute> + Send + Sync + 'static {
    move |trainer| {
        Box::new(MlpCompute {
            trainer,
            hooks: hooks.clone(),
        }) as Box<dyn Compute>
    }
}
