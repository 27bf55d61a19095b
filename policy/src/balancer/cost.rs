//! The cost model: per sample, compute `cost(s) = a·ŝ² + b·ŝ` with `ŝ = s / scale`; per
//! micro-batch, `max(Σ cost(sᵢ), transfer)` — its parameter pulls and gradient pushes overlap its
//! compute, so a micro-batch too small to hide them lasts as long as they do.
//!
//! Guarantees: a model that passes [`CostModel::validate`] gives a finite, non-negative cost for
//! every length up to `u64::MAX` unless its coefficients are so large that the product overflows,
//! which [`CostModel::sample_costs`] reports as [`BalanceError::NonFiniteCost`]. The cost is
//! monotone non-decreasing in the length (both coefficients are non-negative).

use super::BalanceError;

/// The default length scale `ŝ = s / 32000` of ODC's fitted models.
pub const DEFAULT_SCALE: f64 = 32_000.0;

/// Estimated compute cost of one sample of `s` tokens: `a·ŝ² + b·ŝ`, `ŝ = s / scale`.
///
/// The quadratic term models attention, the linear term the rest of the transformer. Only the
/// ratios between costs matter to the balancer, so the unit is arbitrary. `transfer` is what one
/// micro-batch's pulls and pushes occupy its trainer, in the same unit (0: not priced, the
/// default); every micro-batch pays the whole model's transfers once, whatever its size.
///
/// ```
/// use odc_policy::balancer::CostModel;
/// let m = CostModel::odc_7b();
/// assert!((m.cost(32_000) - (4.348357 + 8.768377)).abs() < 1e-12);
/// assert_eq!(CostModel::linear().cost(64_000), 2.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostModel {
    /// Coefficient of the quadratic term.
    pub a: f64,
    /// Coefficient of the linear term.
    pub b: f64,
    /// Length that maps to `ŝ = 1`.
    pub scale: f64,
    /// Transfers of one micro-batch (pulls and pushes, overlapped with its compute).
    #[serde(default)]
    pub transfer: f64,
}

impl CostModel {
    /// Cost proportional to length (`a = 0`, `b = 1`): ODC's `linear` model. The model is linear
    /// only because `a = 0`; any other model built with [`CostModel::quadratic`] is not.
    pub fn linear() -> Self {
        Self::quadratic(0.0, 1.0)
    }

    /// `a·ŝ² + b·ŝ` with the default scale of 32,000 tokens.
    pub fn quadratic(a: f64, b: f64) -> Self {
        Self {
            a,
            b,
            scale: DEFAULT_SCALE,
            transfer: 0.0,
        }
    }

    /// This model with `transfer` per micro-batch (see [`CostModel::micro_batch`]).
    pub fn with_transfer(self, transfer: f64) -> Self {
        Self { transfer, ..self }
    }

    /// ODC's fit for a 7B model (DeepSeek-R1-Distill-Qwen-7B): `a = 4.348357`, `b = 8.768377`.
    pub fn odc_7b() -> Self {
        Self::quadratic(4.348357, 8.768377)
    }

    /// ODC's fit for a 1.5B model (DeepSeek-R1-Distill-Qwen-1.5B): `a = 1.982122`, `b = 2.611821`.
    pub fn odc_1_5b() -> Self {
        Self::quadratic(1.982122, 2.611821)
    }

    /// Cost of one sample of `tokens` tokens. Not checked: see [`CostModel::validate`].
    pub fn cost(&self, tokens: u64) -> f64 {
        let s = tokens as f64 / self.scale;
        self.a * s * s + self.b * s
    }

    /// Cost of one micro-batch whose samples' costs sum to `compute`: `max(compute, transfer)`.
    pub fn micro_batch(&self, compute: f64) -> f64 {
        compute.max(self.transfer)
    }

    /// Checks that `a`, `b` and `transfer` are finite and non-negative and that `scale` is finite
    /// and positive.
    pub fn validate(&self) -> Result<(), BalanceError> {
        let coefficient = "non-negative";
        for (field, value) in [("a", self.a), ("b", self.b), ("transfer", self.transfer)] {
            if !value.is_finite() || value < 0.0 {
                return Err(BalanceError::InvalidCostModel {
                    field: field.to_string(),
                    value,
                    requirement: coefficient.to_string(),
                });
            }
        }
        if !self.scale.is_finite() || self.scale <= 0.0 {
            return Err(BalanceError::InvalidCostModel {
                field: "scale".into(),
                value: self.scale,
                requirement: "positive".into(),
            });
        }
        Ok(())
    }

    /// Validates the model and returns the cost of every sample of `tokens`, in order; fails with
    /// [`BalanceError::NonFiniteCost`] naming the first sample whose cost overflows.
    pub fn sample_costs(&self, tokens: &[u64]) -> Result<Vec<f64>, BalanceError> {
        self.validate()?;
        tokens
            .iter()
            .enumerate()
            .map(|(sample, &t)| {
                let cost = self.cost(t);
                if cost.is_finite() {
                    Ok(cost)
                } else {
                    Err(BalanceError::NonFiniteCost {
                        sample: sample as u64,
                        tokens: t,
                        cost,
                    })
                }
            })
            .collect()
    }
}

impl Default for CostModel {
    /// [`CostModel::odc_7b`].
    fn default() -> Self {
        Self::odc_7b()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(x: f64, y: f64) -> bool {
        (x - y).abs() <= 1e-12 * y.abs().max(1.0)
    }

    #[test]
    fn cost_model_values_match_the_formula() {
        let m = CostModel::odc_7b();
        assert_eq!(m.cost(0), 0.0);
        assert!(close(m.cost(32_000), 4.348357 + 8.768377));
        assert!(close(m.cost(16_000), 4.348357 * 0.25 + 8.768377 * 0.5));
        assert!(close(m.cost(64_000), 4.348357 * 4.0 + 8.768377 * 2.0));
        let small = CostModel::odc_1_5b();
        assert!(close(small.cost(32_000), 1.982122 + 2.611821));
        assert!(close(small.cost(8_000), 1.982122 / 16.0 + 2.611821 / 4.0));
    }

    #[test]
    fn cost_model_linear_is_proportional_to_length() {
        let m = CostModel::linear();
        assert_eq!(m.a, 0.0);
        for t in [1u64, 7, 1000, 32_000, 1 << 40] {
            assert!(close(m.cost(2 * t), 2.0 * m.cost(t)));
        }
        assert_eq!(m.cost(32_000), 1.0);
    }

    #[test]
    fn cost_model_default_is_odc_7b() {
        assert_eq!(CostModel::default(), CostModel::odc_7b());
        assert_eq!(CostModel::default().scale, DEFAULT_SCALE);
    }

    #[test]
    fn cost_model_quadratic_is_superlinear() {
        let m = CostModel::odc_7b();
        assert!(m.cost(64_000) > 2.0 * m.cost(32_000));
    }

    #[test]
    fn cost_model_validate_rejects_bad_fields() {
        assert!(CostModel::odc_7b().validate().is_ok());
        assert!(CostModel::quadratic(0.0, 0.0).validate().is_ok());
        let bad = [
            (CostModel::quadratic(-1.0, 1.0), "a"),
            (CostModel::quadratic(f64::NAN, 1.0), "a"),
            (CostModel::quadratic(1.0, f64::INFINITY), "b"),
            (CostModel::quadratic(1.0, -0.5), "b"),
            (CostModel::linear().with_transfer(-1.0), "transfer"),
            (CostModel::linear().with_transfer(f64::INFINITY), "transfer"),
            (
                CostModel {
                    scale: 0.0,
                    ..CostModel::linear()
                },
                "scale",
            ),
            (
                CostModel {
                    scale: f64::NAN,
                    ..CostModel::linear()
                },
                "scale",
            ),
        ];
        for (model, expected) in bad {
            match model.validate() {
                Err(BalanceError::InvalidCostModel { field, .. }) => assert_eq!(field, expected),
                other => panic!("{model:?}: expected InvalidCostModel, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_micro_batch_lasts_at_least_its_transfers() {
        let m = CostModel::linear();
        assert_eq!(m.micro_batch(0.25), 0.25, "not priced by default");
        let t = m.with_transfer(0.5);
        assert_eq!((t.micro_batch(0.25), t.micro_batch(0.75)), (0.5, 0.75));
        assert_eq!(t.cost(32_000), 1.0, "a sample's cost is compute only");
        // A model saved before `transfer` existed still reads.
        let old: CostModel = serde_json::from_str(r#"{"a":1.0,"b":2.0,"scale":3.0}"#).unwrap();
        assert_eq!(old.transfer, 0.0);
    }

    #[test]
    fn cost_model_sample_costs_reports_overflow() {
        let huge = CostModel::quadratic(f64::MAX, 0.0);
        assert_eq!(
            huge.sample_costs(&[1, 64_000]),
            Err(BalanceError::NonFiniteCost {
                sample: 1,
                tokens: 64_000,
                cost: f64::INFINITY
            })
        );
        let costs = CostModel::linear().sample_costs(&[32_000, 16_000]);
        assert_eq!(costs, Ok(vec![1.0, 0.5]));
    }
}
