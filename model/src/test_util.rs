//! Helpers of the model's unit tests, in one place: seeded random tensors and the error measures
//! every kernel and layer test compares with.

use candle_core::{DType, Device, Tensor, Var};

use super::config::ModelConfig;
use super::params::unit_vars;
use super::transformer::{unit_count, unit_init_values, unit_params};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A seeded fp32 tensor, uniform in [-2, 2) (enough for op checks).
pub(crate) fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Every unit's seeded initial parameters as `Var`s on the CPU, unit by unit.
pub(crate) fn init_vars(config: &ModelConfig) -> Vec<Vec<Var>> {
    (0..unit_count(config))
        .map(|u| {
            let specs = unit_params(config, u).unwrap();
            unit_vars(&unit_init_values(config, u).unwrap(), &specs, &Device::Cpu).unwrap()
        })
        .collect()
}

/// A tensor's elements as fp32, flattened.
pub(crate) fn to_vec(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max |a − b|` over all elements; fails on a shape mismatch or any non-finite element (a NaN
/// would otherwise slip through a max).
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let diff =
        to_vec(&(a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap());
    assert!(diff.iter().all(|d| d.is_finite()), "a non-finite element");
    diff.iter().fold(0.0, |m, d| m.max(d.abs()))
}

/// `max |a − b| / max(1, max |b|)`: the largest error relative to the reference's scale; fails on
/// a shape mismatch or any non-finite element.
pub(crate) fn err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let (a, b) = (to_vec(a), to_vec(b));
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "a non-finite element"
    );
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// `‖a − b‖ / ‖b‖`; fails on a shape mismatch or a non-finite element of `a`.
pub(crate) fn rel(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let (a, b) = (to_vec(a), to_vec(b));
    assert!(a.iter().all(|x| x.is_finite()), "a non-finite element");
    let diff: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f32 = b.iter().map(|y| y * y).sum();
    (diff / norm.max(f32::MIN_POSITIVE)).sqrt()
}
