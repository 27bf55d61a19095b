//! A unit's parameters: their names and shapes in a fixed order ([`ParamSpec`]), their seeded
//! initialisation ([`init_values`]), and the conversion of the unit's flat `f32` buffer (how odc
//! stores, shards and gathers a unit) into candle tensors ([`unit_tensors`], [`unit_vars`]).
//!
//! Guarantees: the flat layout is the specs' order, each tensor row-major; [`init_values`] is a pure
//! function of (specs, std, seed).

use candle_core::{Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

use super::error::{Error, Result};

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamInit {
    /// Normal(0, `init_std`): every matrix.
    Normal,
    /// All ones: norm weights.
    Ones,
    /// All zeros: biases, LoRA's `B`.
    Zeros,
    /// Uniform in `±1/√fan_in`: Kaiming-uniform with `a = √5`, `torch.nn.Linear`'s and PEFT's
    /// initialisation of LoRA's `A`.
    UniformFanIn(usize),
}

/// One named parameter of a unit (the name becomes its safetensors name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Its Hugging Face name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// Row-major shape; linear weights are `[out, in]`.
    pub shape: Vec<usize>,
    /// Its initialisation.
    pub init: ParamInit,
}

impl ParamSpec {
    pub(crate) fn new(name: impl Into<String>, shape: &[usize], init: ParamInit) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            init,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Total elements of a unit's parameters (the length of its flat buffer).
pub fn unit_numel(specs: &[ParamSpec]) -> usize {
    specs.iter().map(ParamSpec::numel).sum()
}

/// The initial flat buffer of a unit: its parameters in order, each drawn from one seeded stream.
pub fn init_values(specs: &[ParamSpec], init_std: f64, seed: u64) -> Result<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, init_std as f32).map_err(|e| Error::Config {
        field: "init_std",
        reason: format!("{init_std}: {e}"),
    })?;
    let mut values = Vec::with_capacity(unit_numel(specs));
    for spec in specs {
        match spec.init {
            ParamInit::Normal => values.extend((0..spec.numel()).map(|_| normal.sample(&mut rng))),
            ParamInit::Ones => values.extend(std::iter::repeat_n(1.0f32, spec.numel())),
            ParamInit::Zeros => values.extend(std::iter::repeat_n(0.0f32, spec.numel())),
            ParamInit::UniformFanIn(fan_in) => {
                let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
                values.extend((0..spec.numel()).map(|_| rng.random_range(-bound..bound)));
            }
        }
    }
    Ok(values)
}

/// Splits a unit's flat buffer into one tensor per parameter (copies; no gradient tracking).
pub fn unit_tensors(flat: &[f32], specs: &[ParamSpec], device: &Device) -> Result<Vec<Tensor>> {
    split(flat, specs, |values, shape| {
        Tensor::from_slice(values, shape, device)
    })
}

/// Each parameter of a unit as a view of its flat tensor `flat` (rank 1, any dtype or device),
/// in `specs` order, no copy; [`Error::UnitParams`] when `flat` is not exactly the unit.
pub fn unit_views(flat: &Tensor, specs: &[ParamSpec]) -> Result<Vec<Tensor>> {
    let expected = unit_numel(specs);
    if flat.rank() != 1 || flat.elem_count() != expected {
        return Err(Error::UnitParams {
            what: "values",
            expected,
            got: flat.elem_count(),
        });
    }
    let mut at = 0;
    specs
        .iter()
        .map(|spec| {
            let view = flat
                .narrow(0, at, spec.numel())?
                .reshape(spec.shape.as_slice())?;
            at += spec.numel();
            Ok(view)
        })
        .collect()
}

/// As [`unit_tensors`], as trainable [`Var`]s (one copy of the values each, as for a tensor): a
/// backward through the unit's forward gives each a gradient.
pub fn unit_vars(flat: &[f32], specs: &[ParamSpec], device: &Device) -> Result<Vec<Var>> {
    split(flat, specs, |values, shape| {
        Var::from_slice(values, shape, device)
    })
}

/// `make(values, shape)` of each parameter's slice of `flat`, in `specs` order; `flat` must be
/// exactly the unit's length.
fn split<T>(
    flat: &[f32],
    specs: &[ParamSpec],
    make: impl Fn(&[f32], &[usize]) -> candle_core::Result<T>,
) -> Result<Vec<T>> {
    let expected = unit_numel(specs);
    if flat.len() != expected {
        return Err(Error::UnitParams {
            what: "values",
            expected,
            got: flat.len(),
        });
    }
    let mut offset = 0;
    let mut out = Vec::with_capacity(specs.len());
    for spec in specs {
        let n = spec.numel();
        out.push(make(&flat[offset..offset + n], spec.shape.as_slice())?);
        offset += n;
    }
    Ok(out)
}

/// The tensors of `vars`, for a unit's forward (same ids: gradients are found by the `Var`s).
pub fn as_tensors(vars: &[Var]) -> Vec<Tensor> {
    vars.iter().map(|v| v.as_tensor().clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("a.weight", &[2, 3], ParamInit::Normal),
            ParamSpec::new("b.weight", &[3], ParamInit::Ones),
        ]
    }

    #[test]
    fn init_is_deterministic_from_the_seed() {
        let a = init_values(&specs(), 0.02, 7).unwrap();
        assert_eq!(a, init_values(&specs(), 0.02, 7).unwrap());
        assert_ne!(a, init_values(&specs(), 0.02, 8).unwrap());
        assert_eq!(a.len(), 9);
        assert_eq!(&a[6..], &[1.0, 1.0, 1.0]);
        assert!(a[..6].iter().all(|v| v.abs() < 0.2 && *v != 0.0));
    }

    #[test]
    fn flat_buffer_splits_in_spec_order() {
        let flat: Vec<f32> = (0..9).map(|i| i as f32).collect();
        let t = unit_tensors(&flat, &specs(), &Device::Cpu).unwrap();
        assert_eq!(
            t[0].to_vec2::<f32>().unwrap(),
            vec![vec![0., 1., 2.], vec![3., 4., 5.]]
        );
        assert_eq!(t[1].to_vec1::<f32>().unwrap(), vec![6., 7., 8.]);
        let err = unit_tensors(&flat[..8], &specs(), &Device::Cpu).unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnitParams {
                    expected: 9,
                    got: 8,
                    ..
                }
            ),
            "{err}"
        );
    }
}
