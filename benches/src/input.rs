//! Limits on user input, checked before anything is allocated or run.
//!
//! # Guarantees
//!
//! - **Counts.** Every count is at least 1 and at most its limit ([`count`]); a zero is refused,
//!   never silently raised to 1.
//! - **Sizes.** A matrix whose minibatch, model or trainer staging would exceed
//!   [`MAX_SAMPLES_PER_STEP`], [`MAX_MODEL_ELEMS`] or [`MAX_STAGED_ELEMS`] is refused naming the
//!   limit ([`check_sizes`]), before any sample or buffer exists.
//! - **Times.** Millisecond knobs are finite, within their range ([`milliseconds`]), and the
//!   longest modelled span and micro-batch fit a [`Duration`] ([`check_modelled_time`]), so neither
//!   the harness nor the simulated device can overflow a duration.
//! - **Outputs.** An output path is writable before the run starts ([`check_output`]): its parent
//!   directory exists and the file can be opened for writing; a file created by the check is
//!   removed again.
//!
//! Every error names the flag and the limit once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use odc::sim::SimDevice;

pub use crate::workload::MAX_SEQUENCE_TOKENS;

/// Most simulated devices (`--devices`).
pub const MAX_DEVICES: usize = 4096;
/// Most samples per device per minibatch (`--minibatch-per-device`).
pub const MAX_MINIBATCH_PER_DEVICE: usize = 65_536;
/// Most samples in one minibatch (devices × minibatch per device).
pub const MAX_SAMPLES_PER_STEP: usize = 1 << 20;
/// Most minibatches per run (`--steps`).
pub const MAX_STEPS: u64 = 10_000;
/// Most A/B repetitions (`--reps`).
pub const MAX_REPS: usize = 1_000;
/// Most units of the simulated model (`--units`).
pub const MAX_UNITS: usize = 1_024;
/// Most elements per unit (`--unit-elems`; 64 MiB in fp32).
pub const MAX_UNIT_ELEMS: usize = 1 << 24;
/// Most elements of the whole model (units × elements per unit; the shard servers hold about five
/// fp32 copies: weights, two optimizer moments, accumulator, published copy).
pub const MAX_MODEL_ELEMS: usize = 1 << 26;
/// Most unit elements over all trainers (devices × elements per unit; each trainer stages a few
/// gathered units).
pub const MAX_STAGED_ELEMS: usize = 1 << 26;
/// Longest `--time-scale-ms` and `--unit-transfer-ms` (one minute).
pub const MAX_MILLISECONDS: f64 = 60_000.0;
/// Longest modelled micro-batch (a year: far inside what a [`Duration`] or an `Instant` plus it
/// can hold).
pub const MAX_MODELLED_SECONDS: f64 = 365.0 * 86_400.0;

/// What was wrong with the input.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A product of counts above its limit.
    #[error("{what} = {value} is above the limit of {limit} ({name})")]
    TooLarge {
        /// The product, in the flags' words.
        what: String,
        /// Its value (saturating).
        value: usize,
        /// The limit.
        limit: usize,
        /// The limit's name in [`crate::input`].
        name: &'static str,
    },
    /// A modelled duration that is not a number or longer than [`MAX_MODELLED_SECONDS`].
    #[error("{what} would be {seconds} s; at most {MAX_MODELLED_SECONDS} s")]
    Duration {
        /// What would last that long.
        what: String,
        /// Its modelled seconds.
        seconds: f64,
    },
    /// A token budget below the longest sequence of a workload.
    #[error(
        "--token-budget {budget} is below the longest sequence of workload {workload} ({longest} tokens)"
    )]
    BudgetBelowLongest {
        /// The budget.
        budget: u64,
        /// The workload's name.
        workload: String,
        /// Its longest sequence.
        longest: u64,
    },
    /// An output file that cannot be written.
    #[error("{flag} {}: cannot write there", path.display())]
    Output {
        /// The flag that named it.
        flag: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Parses a count in `1..=max` (for `--devices`, `--reps`, …): refuses 0 and anything above `max`,
/// naming the limit.
///
/// ```
/// use odc_bench::input::count;
/// assert_eq!(count("8", 4096), Ok(8u64));
/// assert!(count::<u64>("0", 4096).unwrap_err().contains("at least 1"));
/// assert!(count::<u64>("100000", 4096).unwrap_err().contains("at most 4096"));
/// ```
pub fn count<T>(text: &str, max: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + From<u8> + std::fmt::Display + Copy,
{
    let value: T = text
        .trim()
        .parse()
        .map_err(|_| "not a whole number".to_string())?;
    if value < T::from(1) {
        Err("must be at least 1".into())
    } else if value > max {
        Err(format!("at most {max}"))
    } else {
        Ok(value)
    }
}

/// Parses milliseconds: a finite number in `0..=MAX_MILLISECONDS`, and positive unless
/// `zero_allowed`.
///
/// ```
/// use odc_bench::input::milliseconds;
/// assert_eq!(milliseconds("4", false), Ok(4.0));
/// assert_eq!(milliseconds("0", true), Ok(0.0));
/// assert!(milliseconds("0", false).is_err());
/// assert!(milliseconds("NaN", true).is_err());
/// assert!(milliseconds("-1", true).is_err());
/// assert!(milliseconds("1e300", true).unwrap_err().contains("60000"));
/// ```
pub fn milliseconds(text: &str, zero_allowed: bool) -> Result<f64, String> {
    let ms: f64 = text
        .trim()
        .parse()
        .map_err(|_| "not a number".to_string())?;
    if !ms.is_finite() {
        return Err("must be a finite number".into());
    }
    if ms < 0.0 || (ms == 0.0 && !zero_allowed) {
        return Err(if zero_allowed {
            "must not be negative".into()
        } else {
            "must be positive".into()
        });
    }
    if ms > MAX_MILLISECONDS {
        return Err(format!("at most {MAX_MILLISECONDS} ms"));
    }
    Ok(ms)
}

/// `a × b`, refused above `limit` (saturating, so huge inputs cannot wrap).
pub fn check_product(
    what: &str,
    a: usize,
    b: usize,
    limit: usize,
    name: &'static str,
) -> Result<(), InputError> {
    let value = a.saturating_mul(b);
    if value > limit {
        return Err(InputError::TooLarge {
            what: what.into(),
            value,
            limit,
            name,
        });
    }
    Ok(())
}

/// The matrix's sizes: the largest minibatch, model and trainer staging are within
/// [`MAX_SAMPLES_PER_STEP`], [`MAX_MODEL_ELEMS`] and [`MAX_STAGED_ELEMS`].
///
/// ```
/// use odc_bench::input::check_sizes;
/// assert!(check_sizes(&[4, 8, 16], &[1, 2, 4, 8], 4, 16 * 1024).is_ok());
/// let err = check_sizes(&[4096], &[65_536], 4, 1024).unwrap_err();
/// assert!(err.to_string().contains("1048576"), "{err}");
/// ```
pub fn check_sizes(
    devices: &[usize],
    minibatch_per_device: &[usize],
    units: usize,
    unit_elems: usize,
) -> Result<(), InputError> {
    let most_devices = devices.iter().copied().max().unwrap_or(0);
    let most_per_device = minibatch_per_device.iter().copied().max().unwrap_or(0);
    check_product(
        "--devices × --minibatch-per-device (samples per minibatch)",
        most_devices,
        most_per_device,
        MAX_SAMPLES_PER_STEP,
        "MAX_SAMPLES_PER_STEP",
    )?;
    check_product(
        "--units × --unit-elems (model elements)",
        units,
        unit_elems,
        MAX_MODEL_ELEMS,
        "MAX_MODEL_ELEMS",
    )?;
    check_product(
        "--devices × --unit-elems (elements staged by all trainers)",
        most_devices,
        unit_elems,
        MAX_STAGED_ELEMS,
        "MAX_STAGED_ELEMS",
    )
}

/// The longest modelled micro-batch (one sequence of `token_budget` tokens, the costliest a budget
/// allows since the cost is convex) on a device at `slowest_speed` is a valid [`Duration`] of at
/// most [`MAX_MODELLED_SECONDS`] (so are its spans, which are shorter); returns its seconds.
///
/// ```
/// use odc::sim::SimDevice;
/// use odc_bench::input::check_modelled_time;
/// let d = SimDevice::default();
/// assert!(check_modelled_time(&d, 65_536, 0.5).is_ok());
/// let huge = SimDevice { seconds_per_cost: 1e300, ..d };
/// assert!(check_modelled_time(&huge, 65_536, 0.5).is_err());
/// ```
pub fn check_modelled_time(
    device: &SimDevice,
    token_budget: u64,
    slowest_speed: f64,
) -> Result<f64, InputError> {
    let seconds = device.seconds(&[token_budget]) / slowest_speed;
    match Duration::try_from_secs_f64(seconds) {
        Ok(d) if d.as_secs_f64() <= MAX_MODELLED_SECONDS => Ok(seconds),
        _ => Err(InputError::Duration {
            what: format!("the modelled compute of a {token_budget}-token micro-batch"),
            seconds,
        }),
    }
}

/// `path` can be written by `flag`'s output: not a directory, its parent directory exists, and the
/// file can be opened for writing. Leaves an existing file as it was and removes a file it had to
/// create.
pub fn check_output(flag: &'static str, path: &Path) -> Result<(), InputError> {
    let fail = |source| InputError::Output {
        flag,
        path: path.to_path_buf(),
        source,
    };
    if path.is_dir() {
        return Err(fail(std::io::Error::other("it is a directory")));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(fail(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("directory {} does not exist", parent.display()),
        )));
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(fail)?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_refuse_zero_and_above_limit() {
        assert_eq!(count("1", 4096usize), Ok(1));
        assert_eq!(count(" 4096 ", 4096usize), Ok(4096));
        assert_eq!(count("4097", 4096usize), Err("at most 4096".into()));
        assert_eq!(count("0", 4096usize), Err("must be at least 1".into()));
        assert!(count("-3", 4096usize).is_err());
        assert!(count("1.5", 4096usize).is_err());
        assert!(count("99999999999999999999999", u64::MAX).is_err());
    }

    #[test]
    fn milliseconds_refuse_non_finite_negative_and_huge() {
        for bad in ["nan", "inf", "-inf", "-1", "1e300", "x", ""] {
            assert!(milliseconds(bad, true).is_err(), "{bad}");
            assert!(milliseconds(bad, false).is_err(), "{bad}");
        }
        assert!(milliseconds("0", false).is_err());
        assert_eq!(milliseconds("60000", false), Ok(60_000.0));
        assert_eq!(milliseconds("0.25", true), Ok(0.25));
    }

    #[test]
    fn sizes_name_the_limit_and_do_not_wrap() {
        let err = check_sizes(&[usize::MAX], &[usize::MAX], 1, 1).unwrap_err();
        assert!(err.to_string().contains("MAX_SAMPLES_PER_STEP"), "{err}");
        let err = check_sizes(&[8], &[4], MAX_UNITS, MAX_UNIT_ELEMS).unwrap_err();
        assert!(err.to_string().contains("MAX_MODEL_ELEMS"), "{err}");
        let err = check_sizes(&[4096], &[1], 1, MAX_UNIT_ELEMS).unwrap_err();
        assert!(err.to_string().contains("MAX_STAGED_ELEMS"), "{err}");
        assert!(check_sizes(&[MAX_DEVICES], &[256], 4, 16 * 1024).is_ok());
    }

    #[test]
    fn modelled_time_within_the_limits_fits() {
        let d = SimDevice {
            seconds_per_cost: MAX_MILLISECONDS / 1e3,
            ..SimDevice::default()
        };
        let s = check_modelled_time(&d, MAX_SEQUENCE_TOKENS, 0.5).unwrap();
        assert!(s.is_finite() && s > 0.0);
        let nan = SimDevice {
            seconds_per_cost: f64::NAN,
            ..SimDevice::default()
        };
        assert!(check_modelled_time(&nan, 1, 1.0).is_err());
    }

    #[test]
    fn outputs_are_checked_without_leaving_files() {
        let dir = crate::test_util::temp_path("odc-input", "dir");
        std::fs::create_dir_all(&dir).unwrap();
        let fresh = dir.join("out.json");
        check_output("--json", &fresh).unwrap();
        assert!(!fresh.exists(), "the check removes what it created");
        std::fs::write(&fresh, "keep").unwrap();
        check_output("--json", &fresh).unwrap();
        assert_eq!(std::fs::read_to_string(&fresh).unwrap(), "keep");

        let err = check_output("--plot", &dir).unwrap_err();
        assert!(err.to_string().starts_with("--plot"), "{err}");
        let missing = dir.join("no-such-dir").join("t.json");
        let err = check_output("--trace", &missing).unwrap_err();
        let text = crate::error_chain(&err);
        assert!(
            text.contains("no-such-dir") && text.contains("does not exist"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
