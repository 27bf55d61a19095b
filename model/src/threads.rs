//! How many CPU threads each model's candle ops use when several models compute at once.
//!
//! candle 0.11 parallelises every CPU op over process-global thread pools sized once, at first
//! use, from `RAYON_NUM_THREADS` (element-wise ops and gemm) and `CANDLE_NUM_THREADS` (its
//! barrier pool) — every core by default. odc runs several trainers in one process (and
//! `odc launch` several processes on one host), each of which would then split every op over all
//! cores: the pools' workers contend and spin at barriers (the measured cost is in
//! `docs/examples.md`, "CPU threads").
//!
//! [`share_cpu_threads`] gives each concurrently computing model an equal share of the host's
//! cores, as torchrun sets `OMP_NUM_THREADS` for its workers; a variable the user set wins. It
//! sets process environment variables, so call it at the very start of `main`, before any thread
//! (a tokio runtime, a candle op) exists.

/// The fp32 matmul rate, FLOP/s, that `workers` threads reach together on this host's CPU with
/// candle's pools as set: each thread multiplies 512×512 matrices for 100 ms, three times after
/// one warm-up product, and the best of the three is the rate (the least disturbed by whatever
/// else runs). The peak a CPU run's MFU is over, as a GPU's is over its datasheet's.
pub fn matmul_rate(workers: usize) -> crate::Result<f64> {
    use candle_core::{Device, Tensor};
    const N: usize = 512;
    let a = Tensor::randn(0f32, 1.0, (N, N), &Device::Cpu)?;
    a.matmul(&a)?;
    let window = std::time::Duration::from_millis(100);
    let mut best = 0f64;
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let products = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..workers.max(1))
                .map(|_| {
                    scope.spawn(|| -> crate::Result<u64> {
                        let mut n = 0;
                        while started.elapsed() < window {
                            a.matmul(&a)?;
                            n += 1;
                        }
                        Ok(n)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or(Ok(0)))
                .sum::<crate::Result<u64>>()
        })?;
        let flops = products as f64 * 2.0 * (N * N * N) as f64;
        best = best.max(flops / started.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// What [`share_cpu_threads`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuThreads {
    /// Threads per model.
    pub per_model: usize,
    /// The host's cores (`available_parallelism`).
    pub cores: usize,
    /// Processes on this host sharing them (`ODC_LOCAL_WORLD_SIZE`, else torchrun's
    /// `LOCAL_WORLD_SIZE`, else 1).
    pub local_processes: usize,
    /// `None` when odc set the variables; else the variable the user had set, which was kept.
    pub user_set: Option<&'static str>,
}

impl std::fmt::Display for CpuThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.user_set {
            Some(var) => write!(f, "CPU threads as set by {var}"),
            None => write!(
                f,
                "{} CPU thread(s) per trainer ({} cores, {} process(es) on this host)",
                self.per_model, self.cores, self.local_processes
            ),
        }
    }
}

/// The variables candle's CPU pools read.
const POOL_VARS: [&str; 2] = ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"];

/// Splits the host's cores evenly over `models_per_process` models in each of this host's
/// processes, setting candle's pool sizes (at least one thread each) unless the user set either.
/// Must run before any other thread of the process starts (see the module docs).
pub fn share_cpu_threads(models_per_process: usize) -> CpuThreads {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = plan(cores, models_per_process, |name| std::env::var(name).ok());
    if plan.user_set.is_none() {
        for var in POOL_VARS {
            // Edition 2021: safe to call; sound here because no other thread exists yet.
            std::env::set_var(var, plan.per_model.to_string());
        }
    }
    plan
}

/// The decision of [`share_cpu_threads`] from the core count and the environment.
fn plan(
    cores: usize,
    models_per_process: usize,
    get: impl Fn(&str) -> Option<String>,
) -> CpuThreads {
    let local_processes = ["ODC_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"]
        .iter()
        .find_map(|name| get(name)?.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    let sharers = local_processes.saturating_mul(models_per_process.max(1));
    CpuThreads {
        per_model: (cores / sharers).max(1),
        cores,
        local_processes,
        user_set: POOL_VARS.into_iter().find(|name| get(name).is_some()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn cores_split_evenly_over_models_and_local_processes() {
        assert_eq!(plan(16, 2, env(&[])).per_model, 8);
        let launched = plan(16, 1, env(&[("ODC_LOCAL_WORLD_SIZE", "4")]));
        assert_eq!((launched.per_model, launched.local_processes), (4, 4));
        let torchrun = plan(16, 2, env(&[("LOCAL_WORLD_SIZE", "2")]));
        assert_eq!(torchrun.per_model, 4);
    }

    #[test]
    fn at_least_one_thread_each() {
        assert_eq!(plan(2, 8, env(&[])).per_model, 1);
        assert_eq!(plan(1, 0, env(&[])).per_model, 1);
        assert_eq!(
            plan(4, 1, env(&[("ODC_LOCAL_WORLD_SIZE", "0")])).local_processes,
            1
        );
        assert_eq!(
            plan(4, 1, env(&[("ODC_LOCAL_WORLD_SIZE", "x")])).per_model,
            4
        );
    }

    #[test]
    fn a_variable_the_user_set_wins() {
        let kept = plan(16, 2, env(&[("CANDLE_NUM_THREADS", "3")]));
        assert_eq!(kept.user_set, Some("CANDLE_NUM_THREADS"));
        assert_eq!(plan(16, 2, env(&[])).user_set, None);
    }
}
