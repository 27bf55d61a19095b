//! Comparing trained parameters (`#[path]`-included by the test binaries that train models).

/// Largest absolute difference between two parameter sets. Panics (fails the test) if they do
/// not have the same units of the same lengths, or if any value is not finite: a comparison that
/// silently truncated or skipped NaNs could pass on a broken run.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(
        a.len(),
        b.len(),
        "the parameter sets have different unit counts"
    );
    let mut max = 0f32;
    for (unit, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "unit {unit} has different lengths");
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                p.is_finite() && q.is_finite(),
                "unit {unit} element {i} is not finite: {p} vs {q}"
            );
            max = max.max((p - q).abs());
        }
    }
    max
}

/// The largest `|b − a| / |a|` over two runs' step losses; fails on different step counts or a
/// loss that is not finite.
#[allow(dead_code)] // not every binary that includes this compares losses
pub fn worst_loss_diff(a: &[odc::StepStats], b: &[odc::StepStats]) -> f64 {
    assert_eq!(a.len(), b.len(), "step counts differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert!(
                x.loss.is_finite() && y.loss.is_finite(),
                "{} vs {}",
                x.loss,
                y.loss
            );
            ((y.loss - x.loss) / x.loss).abs()
        })
        .fold(0.0, f64::max)
}

#[test]
fn max_abs_diff_refuses_mismatches_and_nan() {
    let a = vec![vec![1.0, 2.0]];
    assert_eq!(max_abs_diff(&a, &[vec![1.5, 2.0]]), 0.5);
    for b in [
        vec![vec![1.0]],
        vec![vec![1.0, f32::NAN]],
        vec![vec![1.0, 2.0], vec![3.0]],
    ] {
        let caught = std::panic::catch_unwind(|| max_abs_diff(&a, &b));
        assert!(caught.is_err(), "{b:?} must not compare");
    }
}
