//! Optimizers on one shard: SGD and AdamW, elementwise, with the semantics of `torch.optim.SGD`
//! and `torch.optim.AdamW`.
//!
//! Guarantees (tested):
//! - **Elementwise**: the update of element `i` depends only on `params[i]`, `grads[i]`, the
//!   state of element `i`, the config and the step count. The per-step scalars (bias corrections,
//!   step size, decay factor) are computed once per step from the config and step count alone, so
//!   splitting a unit into shards and stepping each shard gives bitwise the same parameters as
//!   stepping the whole unit: sharding never changes results (docs/design.md I3).
//! - **All or nothing**: a step that returns an error changes neither the parameters nor the state.
//! - The step count starts at 0 and counts successful steps; AdamW's bias corrections use `t =
//!   steps()` after the increment, so the first step has `t = 1`, as in torch.
//!
//! Per-step scalars are computed in `f64` and rounded to `f32` (torch computes them as Python
//! floats); elementwise arithmetic is `f32`, like torch on `float32` tensors.
//!
//! This module is the optimizer's pure description: [`OptimizerConfig`], the checks and scalars of
//! one step ([`plan_step`], [`StepScalars`]) and the elementwise math documented on
//! [`OptimizerConfig`], run here by host loops over `f32` slices ([`OptimizerState::step`]). A shard
//! server on the GPU (`server/device/`, feature `cuda`) runs the same plan with the same scalars as
//! NVRTC kernels, written in the same order of operations as the host loops. Non-finite gradients
//! are not rejected here (torch does not either): the runtime never hands one to a step (trainers
//! refuse them and the barrier discards a step whose global norm is not finite, see
//! [`crate::step`]).

/// Why an optimizer step or config was rejected. Variants name the field or the lengths involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum OptimizerError {
    /// A hyper-parameter is out of range.
    #[error("optimizer field `{field}` is {value}; it must be {requirement}")]
    InvalidConfig {
        /// Name of the field (`lr`, `momentum`, `weight_decay`, `beta1`, `beta2`, `eps`).
        field: String,
        /// Its value.
        value: f32,
        /// The range it must lie in.
        requirement: String,
    },
    /// `params` and `grads` of one step have different lengths.
    #[error("the step got {params} parameters but {grads} gradients")]
    LengthMismatch {
        /// Length of the parameter slice.
        params: u64,
        /// Length of the gradient slice.
        grads: u64,
    },
    /// The parameter slice is not the length the state was created for.
    #[error("the optimizer state holds {state} elements but the step got {params} parameters")]
    StateLengthMismatch {
        /// Length the state was created for.
        state: u64,
        /// Length of the parameter slice.
        params: u64,
    },
    /// A restored buffer does not fit the state (missing, unknown, repeated, wrong length).
    #[error("optimizer buffer `{buffer}` {reason}")]
    BufferMismatch {
        /// The buffer's name (`exp_avg`, `exp_avg_sq`, `momentum_buffer`).
        buffer: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The state was created for one optimizer and stepped with another's config.
    #[error("the optimizer state was created for {state} but the step uses {config}")]
    KindMismatch {
        /// Optimizer the state belongs to.
        state: String,
        /// Optimizer of the config passed to the step.
        config: String,
    },
}

/// Optimizer hyper-parameters. The learning rate may change between steps (a schedule); the kind
/// may not.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD` with dampening 0 and no Nesterov: `d = g + wd·p`; with momentum,
    /// `buf = d` on the first step and `buf = momentum·buf + d` after, `d = buf`; `p -= lr·d`.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum factor (0 disables the momentum buffer).
        momentum: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// `torch.optim.AdamW`: decoupled decay `p *= 1 − lr·wd`, `m = β₁m + (1−β₁)g`,
    /// `v = β₂v + (1−β₂)g²`, `p −= lr·m̂ / (√v̂ + ε)` with `m̂ = m/(1−β₁ᵗ)`, `v̂ = v/(1−β₂ᵗ)`.
    AdamW {
        /// Learning rate.
        lr: f32,
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the denominator for numerical stability.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
}

impl OptimizerConfig {
    /// Plain SGD with torch's defaults: no momentum, no weight decay.
    pub fn sgd(lr: f32) -> Self {
        Self::Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }

    /// AdamW with torch's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    ///
    /// ```
    /// use odc_policy::optimizer::OptimizerConfig;
    /// let c = OptimizerConfig::adamw(1e-4);
    /// assert!(c.validate().is_ok());
    /// assert_eq!(c.lr(), 1e-4);
    /// ```
    pub fn adamw(lr: f32) -> Self {
        Self::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// The same optimizer with learning rate `lr` (a schedule's value for one step).
    pub fn with_lr(mut self, new_lr: f32) -> Self {
        match &mut self {
            Self::Sgd { lr, .. } | Self::AdamW { lr, .. } => *lr = new_lr,
        }
        self
    }

    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            Self::Sgd { lr, .. } | Self::AdamW { lr, .. } => lr,
        }
    }

    /// `"SGD"` or `"AdamW"`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sgd { .. } => "SGD",
            Self::AdamW { .. } => "AdamW",
        }
    }

    /// Checks the ranges torch checks: `lr`, `momentum`, `weight_decay` finite and ≥ 0; betas in
    /// `[0, 1)`; `eps` finite and > 0.
    pub fn validate(&self) -> Result<(), OptimizerError> {
        let non_negative = |field, value: f32| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(OptimizerError::InvalidConfig {
                    field,
                    value,
                    requirement: "finite and >= 0".into(),
                })
            }
        };
        let beta = |field, value: f32| {
            if (0.0..1.0).contains(&value) {
                Ok(())
            } else {
                Err(OptimizerError::InvalidConfig {
                    field,
                    value,
                    requirement: "in [0, 1)".into(),
                })
            }
        };
        match *self {
            Self::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                non_negative("lr".into(), lr)?;
                non_negative("momentum".into(), momentum)?;
                non_negative("weight_decay".into(), weight_decay)
            }
            Self::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                non_negative("lr".into(), lr)?;
                beta("beta1".into(), beta1)?;
                beta("beta2".into(), beta2)?;
                if !(eps.is_finite() && eps > 0.0) {
                    return Err(OptimizerError::InvalidConfig {
                        field: "eps".into(),
                        value: eps,
                        requirement: "finite and > 0".into(),
                    });
                }
                non_negative("weight_decay".into(), weight_decay)
            }
        }
    }
}

/// The names of AdamW's per-element buffers (torch's), in the order [`OptimizerState::buffers`]
/// returns them.
pub const ADAMW_BUFFERS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
/// The name of SGD's momentum buffer (torch's).
pub const SGD_MOMENTUM_BUFFER: &str = "momentum_buffer";

/// The scalars of one step: everything the elementwise update needs besides the elements and
/// their state, computed once per step from the config and the step number alone, so every shard
/// and every implementation (host loops, device kernels) uses bitwise the same values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepScalars {
    /// `torch.optim.SGD` (see [`OptimizerConfig::Sgd`]): the config's values as they are.
    Sgd {
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    },
    AdamW(AdamScalars),
}

/// AdamW's scalars of step `t`: per element, in this order and in `f32`,
/// `p *= decay`; `m = beta1·m + one_minus_beta1·g`; `v = beta2·v + one_minus_beta2·g·g`;
/// `p += -step_size · (m / (√v / bias_correction2_sqrt + eps))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamScalars {
    /// `1 − lr·weight_decay`.
    pub decay: f32,
    pub beta1: f32,
    /// `1 − β₁`.
    pub one_minus_beta1: f32,
    pub beta2: f32,
    /// `1 − β₂`.
    pub one_minus_beta2: f32,
    /// `lr / (1 − β₁ᵗ)`.
    pub step_size: f32,
    /// `√(1 − β₂ᵗ)`.
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
}

/// Check one step and compute its scalars: `config` valid, `params` and `grads` of one length,
/// that length the state's (`state_len`), the state of `config`'s kind (`state` is
/// [`OptimizerState::name`]'s value); the step number is `steps + 1`. Every implementation of a
/// step starts here, so all refuse the same inputs with the same errors, in the same order.
pub fn plan_step(
    config: &OptimizerConfig,
    state: &str,
    state_len: usize,
    steps: u64,
    params: usize,
    grads: usize,
) -> Result<StepScalars, OptimizerError> {
    config.validate()?;
    if params != grads {
        return Err(OptimizerError::LengthMismatch {
            params: params as u64,
            grads: grads as u64,
        });
    }
    if params != state_len {
        return Err(OptimizerError::StateLengthMismatch {
            state: state_len as u64,
            params: params as u64,
        });
    }
    if state != config.name() {
        return Err(OptimizerError::KindMismatch {
            state: state.to_string(),
            config: config.name().to_string(),
        });
    }
    Ok(match *config {
        OptimizerConfig::Sgd {
            lr,
            momentum,
            weight_decay,
        } => StepScalars::Sgd {
            lr,
            momentum,
            weight_decay,
        },
        OptimizerConfig::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => StepScalars::AdamW(AdamScalars::new(
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            steps.saturating_add(1),
        )),
    })
}

/// Per-element buffers of one optimizer.
#[derive(Debug, Clone, PartialEq)]
enum Buffers {
    /// The momentum buffer, created on the first step with non-zero momentum (as torch).
    Sgd { momentum: Option<Vec<f32>> },
    /// First and second moments.
    AdamW {
        exp_avg: Vec<f32>,
        exp_avg_sq: Vec<f32>,
    },
}

/// Optimizer state of one shard (`len` elements): the step count and the per-element buffers.
///
/// ```
/// use odc_policy::optimizer::{OptimizerConfig, OptimizerState};
/// let config = OptimizerConfig::sgd(0.5);
/// let mut state = OptimizerState::new(&config, 2);
/// let mut params = [1.0, 2.0];
/// state.step(&config, &mut params, &[1.0, -2.0]).unwrap();
/// assert_eq!(params, [0.5, 3.0]);
/// assert_eq!(state.steps(), 1);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    len: usize,
    steps: u64,
    buffers: Buffers,
}

impl OptimizerState {
    /// Fresh state (zero moments, step 0) for `len` elements of the optimizer `config` names.
    pub fn new(config: &OptimizerConfig, len: usize) -> Self {
        let buffers = match config {
            OptimizerConfig::Sgd { .. } => Buffers::Sgd { momentum: None },
            OptimizerConfig::AdamW { .. } => Buffers::AdamW {
                exp_avg: vec![0.0; len],
                exp_avg_sq: vec![0.0; len],
            },
        };
        Self {
            len,
            steps: 0,
            buffers,
        }
    }

    /// Number of elements this state is for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether this state is for zero elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of successful steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// `"SGD"` or `"AdamW"`: the optimizer this state belongs to ([`OptimizerConfig::name`]).
    pub fn name(&self) -> &'static str {
        match &self.buffers {
            Buffers::Sgd { .. } => "SGD",
            Buffers::AdamW { .. } => "AdamW",
        }
    }

    /// The names of the per-element buffers this state holds, in the order [`Self::buffers`]
    /// returns them: torch's names ([`ADAMW_BUFFERS`] for AdamW; [`SGD_MOMENTUM_BUFFER`] for SGD
    /// once a step with momentum created it).
    pub fn buffer_names(&self) -> &'static [&'static str] {
        match &self.buffers {
            Buffers::Sgd { momentum: None } => &[],
            Buffers::Sgd { momentum: Some(_) } => &[SGD_MOMENTUM_BUFFER],
            Buffers::AdamW { .. } => &ADAMW_BUFFERS,
        }
    }

    /// The per-element buffers, named by [`Self::buffer_names`] (for checkpoints).
    pub fn buffers(&self) -> Vec<&[f32]> {
        match &self.buffers {
            Buffers::Sgd { momentum: None } => vec![],
            Buffers::Sgd { momentum: Some(b) } => vec![b],
            Buffers::AdamW {
                exp_avg,
                exp_avg_sq,
            } => vec![exp_avg, exp_avg_sq],
        }
    }

    /// A state restored from a checkpoint: `steps` taken and the buffers by name (see
    /// [`Self::buffer_names`]), each `len` long. Fails naming the buffer that is missing, unknown
    /// or of the wrong length; no buffers with `steps > 0` is valid only for SGD (no momentum yet).
    /// No buffers at step 0 is a fresh state ([`Self::new`]) for either optimizer: what the
    /// checkpoint of a frozen unit holds, so a run may resume with it trainable.
    ///
    /// ```
    /// use odc_policy::optimizer::{OptimizerConfig, OptimizerState};
    /// let config = OptimizerConfig::adamw(1e-3);
    /// let mut a = OptimizerState::new(&config, 2);
    /// let mut p = [1.0, 2.0];
    /// a.step(&config, &mut p, &[0.5, -0.5]).unwrap();
    /// let named: Vec<(String, Vec<f32>)> = a.buffer_names().iter().zip(a.buffers())
    ///     .map(|(n, b)| (n.to_string(), b.to_vec())).collect();
    /// let b = OptimizerState::restore(&config, 2, a.steps(), named).unwrap();
    /// assert_eq!(a, b);
    /// ```
    pub fn restore(
        config: &OptimizerConfig,
        len: usize,
        steps: u64,
        buffers: Vec<(String, Vec<f32>)>,
    ) -> Result<Self, OptimizerError> {
        if steps == 0 && buffers.is_empty() {
            return Ok(Self::new(config, len));
        }
        let mut named: std::collections::BTreeMap<String, Vec<f32>> = Default::default();
        for (name, values) in buffers {
            if values.len() != len {
                return Err(OptimizerError::BufferMismatch {
                    buffer: name,
                    reason: format!("has {} elements, the state is for {len}", values.len()),
                });
            }
            if named.insert(name.clone(), values).is_some() {
                return Err(OptimizerError::BufferMismatch {
                    buffer: name,
                    reason: "is given twice".into(),
                });
            }
        }
        let mut take = |name: &str| {
            named
                .remove(name)
                .ok_or_else(|| OptimizerError::BufferMismatch {
                    buffer: name.to_string(),
                    reason: format!("is missing from the {} state", config.name()),
                })
        };
        let buffers = match config {
            OptimizerConfig::Sgd { .. } => Buffers::Sgd {
                momentum: take(SGD_MOMENTUM_BUFFER).ok(),
            },
            OptimizerConfig::AdamW { .. } => Buffers::AdamW {
                exp_avg: take(ADAMW_BUFFERS[0])?,
                exp_avg_sq: take(ADAMW_BUFFERS[1])?,
            },
        };
        if let Some(name) = named.into_keys().next() {
            return Err(OptimizerError::BufferMismatch {
                buffer: name,
                reason: format!("is not a buffer of {}", config.name()),
            });
        }
        Ok(Self {
            len,
            steps,
            buffers,
        })
    }

    /// One optimizer step: updates `params` in place from `grads`. Fails, changing nothing, when
    /// the config is invalid or of another optimizer than the state, or when the lengths of
    /// `params`, `grads` and the state differ.
    pub fn step(
        &mut self,
        config: &OptimizerConfig,
        params: &mut [f32],
        grads: &[f32],
    ) -> Result<(), OptimizerError> {
        let scalars = plan_step(
            config,
            self.name(),
            self.len,
            self.steps,
            params.len(),
            grads.len(),
        )?;
        match (&mut self.buffers, scalars) {
            (
                Buffers::Sgd { momentum: buffer },
                StepScalars::Sgd {
                    lr,
                    momentum,
                    weight_decay,
                },
            ) => sgd_step(buffer, lr, momentum, weight_decay, params, grads),
            (
                Buffers::AdamW {
                    exp_avg,
                    exp_avg_sq,
                },
                StepScalars::AdamW(scalars),
            ) => adamw_step(&scalars, exp_avg, exp_avg_sq, params, grads),
            // `plan_step` checked the kinds agree.
            (_, _) => {
                return Err(OptimizerError::KindMismatch {
                    state: self.name().to_string(),
                    config: config.name().to_string(),
                })
            }
        }
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }
}

fn sgd_step(
    buffer: &mut Option<Vec<f32>>,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    params: &mut [f32],
    grads: &[f32],
) {
    let direction = |p: f32, g: f32| {
        if weight_decay != 0.0 {
            g + weight_decay * p
        } else {
            g
        }
    };
    if momentum == 0.0 {
        for (p, &g) in params.iter_mut().zip(grads) {
            *p += -lr * direction(*p, g);
        }
        return;
    }
    match buffer {
        Some(buf) => {
            for ((p, &g), b) in params.iter_mut().zip(grads).zip(buf.iter_mut()) {
                *b = momentum * *b + direction(*p, g);
                *p += -lr * *b;
            }
        }
        None => {
            let mut buf = Vec::with_capacity(params.len());
            for (p, &g) in params.iter_mut().zip(grads) {
                let d = direction(*p, g);
                buf.push(d);
                *p += -lr * d;
            }
            *buffer = Some(buf);
        }
    }
}

impl AdamScalars {
    /// The scalars of step `t` (1-based) of AdamW with these hyper-parameters.
    fn new(lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32, t: u64) -> Self {
        let (lr64, b1, b2) = (f64::from(lr), f64::from(beta1), f64::from(beta2));
        // Exponents beyond i32 change nothing: β^t has long underflowed to 0 by then.
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - b1.powi(t);
        let bias_correction2 = 1.0 - b2.powi(t);
        Self {
            decay: (1.0 - lr64 * f64::from(weight_decay)) as f32,
            beta1,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr64 / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps,
        }
    }
}

fn adamw_step(
    s: &AdamScalars,
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    params: &mut [f32],
    grads: &[f32],
) {
    let elements = params
        .iter_mut()
        .zip(grads)
        .zip(exp_avg.iter_mut().zip(exp_avg_sq.iter_mut()));
    for ((p, &g), (m, v)) in elements {
        *p *= s.decay;
        *m = s.beta1 * *m + s.one_minus_beta1 * g;
        *v = s.beta2 * *v + s.one_minus_beta2 * g * g;
        let denom = v.sqrt() / s.bias_correction2_sqrt + s.eps;
        *p += -s.step_size * (*m / denom);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(x: f32, y: f64) -> bool {
        (f64::from(x) - y).abs() <= 1e-6 * y.abs().max(1.0)
    }

    #[test]
    fn adamw_matches_hand_computed_two_steps() {
        let config = OptimizerConfig::AdamW {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut state = OptimizerState::new(&config, 2);
        let mut params = [1.0_f32, -2.0];
        // Step 1: m̂ = g, v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g).
        state.step(&config, &mut params, &[0.5, -0.25]).unwrap();
        assert!(close(params[0], 1.0 * 0.999 - 0.1), "{}", params[0]);
        assert!(close(params[1], -2.0 * 0.999 + 0.1), "{}", params[1]);
        assert!(close(params[0], 0.899));
        // Step 2 with the same gradient: m = 0.095, bc1 = 0.19; v = 0.00049975, bc2 = 0.001999.
        state.step(&config, &mut params, &[0.5, -0.25]).unwrap();
        assert!(close(params[0], 0.798101), "{}", params[0]);
        assert!(close(params[1], -1.796102), "{}", params[1]);
        assert_eq!(state.steps(), 2);
    }

    #[test]
    fn adamw_second_step_with_different_gradient() {
        let config = OptimizerConfig::AdamW {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut state = OptimizerState::new(&config, 1);
        let mut p = [0.0_f32];
        state.step(&config, &mut p, &[1.0]).unwrap();
        state.step(&config, &mut p, &[3.0]).unwrap();
        // m = 0.09 + 0.3 = 0.39, m̂ = 0.39/0.19; v = 0.000999 + 0.009 = 0.009999, v̂ = v/0.001999.
        let m_hat = 0.39 / 0.19;
        let v_hat = 0.009999_f64 / 0.001999;
        let expected = -0.01 - 0.01 * m_hat / (v_hat.sqrt() + 1e-8);
        assert!(close(p[0], expected), "{} vs {expected}", p[0]);
    }

    #[test]
    fn adamw_zero_gradient_only_decays() {
        let config = OptimizerConfig::adamw(0.5);
        let mut state = OptimizerState::new(&config, 1);
        let mut p = [2.0_f32];
        state.step(&config, &mut p, &[0.0]).unwrap();
        assert!(close(p[0], 2.0 * (1.0 - 0.5 * 0.01)));
    }

    #[test]
    fn sgd_matches_hand_computed_two_steps() {
        let config = OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.1,
        };
        let mut state = OptimizerState::new(&config, 1);
        let mut p = [1.0_f32];
        // d = 0.5 + 0.1·1 = 0.6 = buf; p = 1 − 0.06.
        state.step(&config, &mut p, &[0.5]).unwrap();
        assert!(close(p[0], 0.94), "{}", p[0]);
        // d = 0.5 + 0.094 = 0.594; buf = 0.54 + 0.594 = 1.134; p = 0.94 − 0.1134.
        state.step(&config, &mut p, &[0.5]).unwrap();
        assert!(close(p[0], 0.8266), "{}", p[0]);
    }

    #[test]
    fn sgd_without_momentum_is_plain_gradient_descent() {
        let config = OptimizerConfig::sgd(0.25);
        let mut state = OptimizerState::new(&config, 3);
        let mut p = [1.0_f32, 0.0, -1.0];
        state.step(&config, &mut p, &[4.0, -4.0, 0.0]).unwrap();
        assert_eq!(p, [0.0, 1.0, -1.0]);
        state.step(&config, &mut p, &[4.0, -4.0, 0.0]).unwrap();
        assert_eq!(p, [-1.0, 2.0, -1.0]);
    }

    #[test]
    fn optimizer_defaults_match_torch() {
        assert_eq!(
            OptimizerConfig::adamw(1e-3),
            OptimizerConfig::AdamW {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01
            }
        );
        assert_eq!(
            OptimizerConfig::sgd(0.1),
            OptimizerConfig::Sgd {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.0
            }
        );
        assert_eq!(OptimizerConfig::sgd(0.1).name(), "SGD");
        assert_eq!(OptimizerConfig::adamw(0.1).name(), "AdamW");
    }

    #[test]
    fn optimizer_validate_rejects_out_of_range_fields() {
        let adam = OptimizerConfig::adamw(1e-3);
        let with = |f: &dyn Fn(&mut f32, &mut f32, &mut f32, &mut f32, &mut f32)| {
            let mut c = adam;
            if let OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } = &mut c
            {
                f(lr, beta1, beta2, eps, weight_decay);
            }
            c
        };
        let cases: [(OptimizerConfig, &str); 8] = [
            (with(&|lr, _, _, _, _| *lr = -1.0), "lr"),
            (with(&|lr, _, _, _, _| *lr = f32::NAN), "lr"),
            (with(&|_, b1, _, _, _| *b1 = 1.0), "beta1"),
            (with(&|_, _, b2, _, _| *b2 = -0.1), "beta2"),
            (with(&|_, _, _, eps, _| *eps = 0.0), "eps"),
            (with(&|_, _, _, _, wd| *wd = f32::INFINITY), "weight_decay"),
            (
                OptimizerConfig::Sgd {
                    lr: 0.1,
                    momentum: -0.5,
                    weight_decay: 0.0,
                },
                "momentum",
            ),
            (OptimizerConfig::sgd(f32::INFINITY), "lr"),
        ];
        for (config, expected) in cases {
            match config.validate() {
                Err(OptimizerError::InvalidConfig { field, .. }) => assert_eq!(field, expected),
                other => panic!("{config:?}: expected InvalidConfig, got {other:?}"),
            }
        }
        assert!(adam.validate().is_ok());
    }

    #[test]
    fn optimizer_step_errors_change_nothing() {
        let config = OptimizerConfig::adamw(0.1);
        let mut state = OptimizerState::new(&config, 2);
        let fresh = state.clone();
        let mut p = [1.0_f32, 2.0];
        assert_eq!(
            state.step(&config, &mut p, &[1.0]),
            Err(OptimizerError::LengthMismatch {
                params: 2,
                grads: 1
            })
        );
        let mut p3 = [1.0_f32, 2.0, 3.0];
        assert_eq!(
            state.step(&config, &mut p3, &[1.0, 1.0, 1.0]),
            Err(OptimizerError::StateLengthMismatch {
                state: 2,
                params: 3
            })
        );
        assert_eq!(
            state.step(&OptimizerConfig::sgd(0.1), &mut p, &[1.0, 1.0]),
            Err(OptimizerError::KindMismatch {
                state: "AdamW".into(),
                config: "SGD".into()
            })
        );
        assert!(matches!(
            state.step(&OptimizerConfig::adamw(-1.0), &mut p, &[1.0, 1.0]),
            Err(OptimizerError::InvalidConfig { field, .. }) if field == "lr"
        ));
        assert_eq!(p, [1.0, 2.0]);
        assert_eq!(p3, [1.0, 2.0, 3.0]);
        assert_eq!(state, fresh);
        assert_eq!(state.steps(), 0);
        assert_eq!(state.len(), 2);
    }

    /// A frozen unit's checkpoint (0 steps, no buffers) restores to a fresh state, so a unit
    /// frozen in one run can train in the next; no buffers after steps is still refused for
    /// AdamW.
    #[test]
    fn restoring_no_buffers_at_step_zero_is_a_fresh_state() {
        for config in [OptimizerConfig::adamw(1e-3), OptimizerConfig::sgd(0.1)] {
            let restored = OptimizerState::restore(&config, 3, 0, Vec::new()).unwrap();
            assert_eq!(restored, OptimizerState::new(&config, 3));
        }
        let err = OptimizerState::restore(&OptimizerConfig::adamw(1e-3), 3, 2, Vec::new());
        assert!(
            matches!(&err, Err(OptimizerError::BufferMismatch { buffer, .. }) if buffer == "exp_avg"),
            "{err:?}"
        );
    }

    /// Straightforward f64 AdamW, for comparison over many steps.
    fn reference_adamw(lr: f64, wd: f64, steps: &[Vec<f32>], init: &[f32]) -> Vec<f64> {
        let (b1, b2, eps) = (0.9_f64, 0.999_f64, 1e-8_f64);
        let mut p: Vec<f64> = init.iter().map(|&x| f64::from(x)).collect();
        let mut m = vec![0.0; p.len()];
        let mut v = vec![0.0; p.len()];
        for (t, g) in steps.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..p.len() {
                let g = f64::from(g[i]);
                p[i] *= 1.0 - lr * wd;
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let m_hat = m[i] / (1.0 - b1.powi(t));
                let v_hat = v[i] / (1.0 - b2.powi(t));
                p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
            }
        }
        p
    }

    fn grads_strategy(len: usize, steps: usize) -> impl Strategy<Value = Vec<Vec<f32>>> {
        prop::collection::vec(prop::collection::vec(-10.0f32..10.0, len), steps)
    }

    proptest! {
        #[test]
        fn adamw_matches_f64_reference(
            (init, grads) in (1usize..16).prop_flat_map(|len| (
                prop::collection::vec(-5.0f32..5.0, len),
                grads_strategy(len, 5),
            )),
        ) {
            let config = OptimizerConfig::adamw(1e-2);
            let mut state = OptimizerState::new(&config, init.len());
            let mut p = init.clone();
            for g in &grads {
                state.step(&config, &mut p, g).unwrap();
            }
            let expected = reference_adamw(1e-2, 0.01, &grads, &init);
            for (got, want) in p.iter().zip(&expected) {
                prop_assert!((f64::from(*got) - want).abs() < 1e-4, "{got} vs {want}");
            }
        }

        #[test]
        fn sharded_steps_equal_whole_step_bitwise(
            (init, grads, cuts) in (1usize..64).prop_flat_map(|len| (
                prop::collection::vec(-5.0f32..5.0, len),
                grads_strategy(len, 4),
                prop::collection::vec(0..=len, 0..5),
            )),
            adam in any::<bool>(),
        ) {
            let config = if adam {
                OptimizerConfig::adamw(3e-3)
            } else {
                OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.01 }
            };
            let mut whole = init.clone();
            let mut whole_state = OptimizerState::new(&config, whole.len());

            let mut bounds = cuts;
            bounds.push(0);
            bounds.push(init.len());
            bounds.sort_unstable();
            bounds.dedup();
            let ranges: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
            let mut shards: Vec<(Vec<f32>, OptimizerState)> = ranges
                .iter()
                .map(|&(a, b)| (init[a..b].to_vec(), OptimizerState::new(&config, b - a)))
                .collect();

            for g in &grads {
                whole_state.step(&config, &mut whole, g).unwrap();
                for ((shard, state), &(a, b)) in shards.iter_mut().zip(&ranges) {
                    state.step(&config, shard, &g[a..b]).unwrap();
                }
            }
            let joined: Vec<u32> = shards
                .iter()
                .flat_map(|(s, _)| s.iter().map(|x| x.to_bits()))
                .collect();
            let whole_bits: Vec<u32> = whole.iter().map(|x| x.to_bits()).collect();
            prop_assert_eq!(joined, whole_bits);
        }
    }
}
