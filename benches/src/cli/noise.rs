//! `--noise` and `--straggler-every`, shared by `ab` and `sim`: the costs a planner cannot see
//! ([`odc::sim::Noise`]).

use odc::sim::Noise;

/// `--noise`'s log-σs and the straggler spacing it implies (64 for `calibrated`, else none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NoiseArg {
    sample_sigma: f64,
    layer_sigma: f64,
    straggler_every: u32,
}

/// `--noise`: `off`, `calibrated`, or two log-σs `SAMPLE,LAYER`, each in [0, 1].
pub(crate) fn noise_arg(s: &str) -> Result<NoiseArg, String> {
    let n = match s.trim() {
        "off" | "none" => Some(Noise::none()),
        "calibrated" => Some(Noise::calibrated(0)),
        _ => None,
    };
    if let Some(n) = n {
        return Ok(NoiseArg {
            sample_sigma: n.sample_sigma,
            layer_sigma: n.layer_sigma,
            straggler_every: n.straggler_every,
        });
    }
    let parts: Vec<Result<f64, _>> = s.split(',').map(|p| p.trim().parse::<f64>()).collect();
    let sigma = 0.0..=1.0;
    match parts.as_slice() {
        [Ok(a), Ok(b)] if sigma.contains(a) && sigma.contains(b) => Ok(NoiseArg {
            sample_sigma: *a,
            layer_sigma: *b,
            straggler_every: 0,
        }),
        _ => Err(format!(
            "--noise is `off`, `calibrated` or two log-sigmas in [0, 1] as `SAMPLE,LAYER` (e.g. \
             `0.1,0.05`), not `{s}`"
        )),
    }
}

impl NoiseArg {
    /// The run's noise: these log-σs, `seed`, and one straggler in `straggler_every` (else the
    /// spacing the argument implies).
    pub(crate) fn noise(self, seed: u64, straggler_every: Option<u32>) -> Noise {
        Noise {
            seed,
            sample_sigma: self.sample_sigma,
            layer_sigma: self.layer_sigma,
            straggler_every: straggler_every.unwrap_or(self.straggler_every),
        }
    }
}
