//! Sequence-length workloads for benchmarks: seeded, reproducible lists of sample lengths in tokens.
//!
//! # Guarantees
//!
//! - **Reproducible.** [`Workload::sample`] is a pure function of the workload, `n` and `seed`: the
//!   same arguments give the same lengths (the generator is [`StdRng`] seeded with
//!   [`SeedableRng::seed_from_u64`]; `rand` does not promise the same stream across its own major
//!   versions, so reproducibility holds for one build of this crate).
//! - **Ranges.** Every length lies in the documented range of its workload; no length is zero unless a
//!   caller built [`Workload::Balanced`] with `tokens: 0`.
//! - **Parsing.** [`parse_lengths`] accepts only positive integers up to [`MAX_SEQUENCE_TOKENS`] and
//!   rejects anything else with the 1-based line number and the offending text; it never panics.
//!   [`Workload::from_file`] reads at most [`MAX_LENGTHS_FILE_BYTES`].
//! - **Bounded lengths.** Every length a workload yields is at most [`Workload::max_tokens`], which is
//!   at most [`MAX_SEQUENCE_TOKENS`] for the built-ins and for lists that came through
//!   [`parse_lengths`].
//!
//! # Built-in distributions
//!
//! The shapes follow the data sets in `PAPERS.md`; parameters were chosen so the means match the
//! published ones (analytic means of the parameters: 16,503, 34,690 and 4,497 tokens). Measured means
//! below are over 20,000 samples with seed 0, then seeds 1 and 12345 in parentheses; the tests check
//! them within ±5% for these three seeds.
//!
//! | name | shape | range (tokens) | target mean | measured mean |
//! |---|---|---|---|---|
//! | `longalign` | 8192 + exponential (θ = 8372) truncated at 65536 (inverse CDF, no clamping spike) | 8192..=65536 | ≈16.5K | 16,399 (16,598, 16,470) |
//! | `swesmith` | lognormal (median 31,260, σ = 0.6) clamped; ≈11% of trajectories sit at the 64K cap | 2048..=65536 | ≈34.7K | 34,606 (34,827, 34,639) |
//! | `rl` | prompt uniform in 256..=1024 + lognormal response (median 2,877, σ = 0.8), clamped at 16K (≈1.7% truncated responses) | 256..=16384 | ≈4.5K (3.5K–5.5K) | 4,471 (4,511, 4,489) |
//! | `balanced` | every sample has the same length (16384 for [`Workload::from_name`]) | = tokens | = tokens | = tokens |
//!
//! [`Workload::Lengths`] draws uniformly with replacement from a list of lengths, for example one read
//! by [`Workload::from_file`].

use std::io::Read as _;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// Smallest LongAlign-like length.
const LONGALIGN_MIN: u64 = 8192;
/// Largest LongAlign-like length.
const LONGALIGN_MAX: u64 = 65536;
/// Scale θ of the exponential excess over [`LONGALIGN_MIN`]; with truncation at the maximum the mean
/// is 8192 + 8311 ≈ 16.5K.
const LONGALIGN_THETA: f64 = 8372.0;

/// Smallest SWE-Smith-like length.
const SWESMITH_MIN: u64 = 2048;
/// SWE-Smith-like cap (the context length trajectories are cut at).
const SWESMITH_MAX: u64 = 65536;
/// Median of the SWE-Smith-like lognormal before clamping.
const SWESMITH_MEDIAN: f64 = 31_260.0;
/// σ of the SWE-Smith-like lognormal.
const SWESMITH_SIGMA: f64 = 0.6;

/// Prompt lengths of RL samples are uniform in this range.
const RL_PROMPT: std::ops::RangeInclusive<u64> = 256..=1024;
/// Largest RL sample (prompt + response).
const RL_MAX: u64 = 16384;
/// Median of the RL response lognormal.
const RL_RESPONSE_MEDIAN: f64 = 2877.0;
/// σ of the RL response lognormal.
const RL_RESPONSE_SIGMA: f64 = 0.8;

/// Length of every sample of the `balanced` built-in.
const BALANCED_TOKENS: u64 = 16384;

/// Longest sequence the benchmark accepts, in tokens (1,048,576 = 2^20: sixteen times the longest
/// built-in sample). Longer lengths are refused where they enter (a lengths file line,
/// `--token-budget`), so modelled times and token budgets stay far from overflow.
pub const MAX_SEQUENCE_TOKENS: u64 = 1 << 20;

/// Largest lengths file [`Workload::from_file`] reads (64 MiB: millions of lines).
pub const MAX_LENGTHS_FILE_BYTES: u64 = 64 << 20;

/// Names accepted by [`Workload::from_name`].
pub const BUILTIN_NAMES: [&str; 4] = ["longalign", "swesmith", "rl", "balanced"];

/// What went wrong reading a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A line that is not a positive integer.
    #[error("line {line}: {text:?}: {reason}")]
    BadLine {
        /// 1-based line number.
        line: usize,
        /// The line as written (trimmed).
        text: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The input held no lengths (only blank lines and comments, or nothing).
    #[error("no sequence lengths found (one positive integer per line expected)")]
    Empty,
    /// A lengths file could not be read.
    #[error("cannot read lengths file {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A lengths file larger than [`MAX_LENGTHS_FILE_BYTES`].
    #[error("lengths file {} is larger than {} MiB", path.display(), MAX_LENGTHS_FILE_BYTES >> 20)]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A lengths file was read but its contents were rejected (the message is the file; the
    /// source says what was wrong).
    #[error("lengths file {}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// A [`WorkloadError::BadLine`] or [`WorkloadError::Empty`].
        source: Box<WorkloadError>,
    },
}

impl WorkloadError {
    /// The 1-based line number of a rejected line, looking through [`WorkloadError::InFile`].
    pub fn line(&self) -> Option<usize> {
        match self {
            WorkloadError::BadLine { line, .. } => Some(*line),
            WorkloadError::InFile { source, .. } => source.line(),
            _ => None,
        }
    }
}

/// A distribution of sequence lengths (tokens per sample).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workload {
    /// LongAlign-10k-like SFT: 8K–64K tokens, mean ≈16.5K, heavy right tail.
    LongAlign,
    /// SWE-Smith-trajectory-like SFT: mean ≈34.7K, capped at 64K.
    SweSmith,
    /// GRPO-like RL rollouts (prompt + response): mean ≈4.5K, at most 16K.
    Rl,
    /// Every sample has `tokens` tokens: nothing for a balancer to win.
    Balanced {
        /// Length of every sample.
        tokens: u64,
    },
    /// Uniform draws, with replacement, from a given list (for example a file of lengths).
    Lengths {
        /// Name shown in reports (the file stem for [`Workload::from_file`]).
        name: String,
        /// The lengths to draw from.
        lengths: Vec<u64>,
    },
}

impl Workload {
    /// The short name used in reports and on the command line: `longalign`, `swesmith`, `rl`,
    /// `balanced`, or the name of a [`Workload::Lengths`].
    pub fn name(&self) -> String {
        match self {
            Workload::LongAlign => "longalign".into(),
            Workload::SweSmith => "swesmith".into(),
            Workload::Rl => "rl".into(),
            Workload::Balanced { .. } => "balanced".into(),
            Workload::Lengths { name, .. } => name.clone(),
        }
    }

    /// A built-in workload by name (one of [`BUILTIN_NAMES`], ASCII case-insensitive, surrounding
    /// whitespace ignored; `balanced` has 16384 tokens per sample). `None` for anything else.
    ///
    /// ```
    /// use odc_bench::workload::Workload;
    /// assert_eq!(Workload::from_name("RL"), Some(Workload::Rl));
    /// assert_eq!(Workload::from_name("balanced"), Some(Workload::Balanced { tokens: 16384 }));
    /// assert_eq!(Workload::from_name("gsm8k"), None);
    /// ```
    pub fn from_name(s: &str) -> Option<Workload> {
        match s.trim().to_ascii_lowercase().as_str() {
            "longalign" => Some(Workload::LongAlign),
            "swesmith" => Some(Workload::SweSmith),
            "rl" => Some(Workload::Rl),
            "balanced" => Some(Workload::Balanced {
                tokens: BALANCED_TOKENS,
            }),
            _ => None,
        }
    }

    /// A [`Workload::Lengths`] read from a file of lengths (format: [`parse_lengths`]), named after
    /// the file stem (`"lengths"` if the path has none).
    ///
    /// Errors: [`WorkloadError::Io`] if the file cannot be read (or is not UTF-8);
    /// [`WorkloadError::TooLarge`] beyond [`MAX_LENGTHS_FILE_BYTES`] (read no further, so a device
    /// file cannot exhaust memory); [`WorkloadError::InFile`] wrapping the parse error otherwise.
    pub fn from_file(path: &Path) -> Result<Workload, WorkloadError> {
        let io = |source| WorkloadError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_LENGTHS_FILE_BYTES + 1).read_to_string(&mut text))
            .map_err(io)?;
        if text.len() as u64 > MAX_LENGTHS_FILE_BYTES {
            return Err(WorkloadError::TooLarge {
                path: path.to_path_buf(),
            });
        }
        let lengths = parse_lengths(&text).map_err(|e| WorkloadError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "lengths".into());
        Ok(Workload::Lengths { name, lengths })
    }

    /// The longest length [`Workload::sample`] can yield (0 for an empty [`Workload::Lengths`]).
    ///
    /// ```
    /// use odc_bench::workload::Workload;
    /// assert_eq!(Workload::Rl.max_tokens(), 16384);
    /// assert_eq!(Workload::Lengths { name: "f".into(), lengths: vec![3, 9, 4] }.max_tokens(), 9);
    /// ```
    pub fn max_tokens(&self) -> u64 {
        match self {
            Workload::LongAlign => LONGALIGN_MAX,
            Workload::SweSmith => SWESMITH_MAX,
            Workload::Rl => RL_MAX,
            Workload::Balanced { tokens } => *tokens,
            Workload::Lengths { lengths, .. } => lengths.iter().copied().max().unwrap_or(0),
        }
    }

    /// `n` sequence lengths drawn with a generator seeded by `seed`: the same arguments always give
    /// the same lengths. A [`Workload::Lengths`] with an empty list yields an empty vector.
    ///
    /// ```
    /// use odc_bench::workload::Workload;
    /// let a = Workload::LongAlign.sample(100, 7);
    /// assert_eq!(a, Workload::LongAlign.sample(100, 7));
    /// assert!(a.iter().all(|&s| (8192..=65536).contains(&s)));
    /// ```
    pub fn sample(&self, n: usize, seed: u64) -> Vec<u64> {
        let mut rng = StdRng::seed_from_u64(seed);
        match self {
            Workload::LongAlign => (0..n).map(|_| longalign(&mut rng)).collect(),
            Workload::SweSmith => (0..n).map(|_| swesmith(&mut rng)).collect(),
            Workload::Rl => (0..n).map(|_| rl(&mut rng)).collect(),
            Workload::Balanced { tokens } => vec![*tokens; n],
            Workload::Lengths { lengths, .. } => {
                if lengths.is_empty() {
                    return Vec::new();
                }
                (0..n)
                    .map(|_| lengths[rng.random_range(0..lengths.len())])
                    .collect()
            }
        }
    }
}

/// 8192 + an exponential excess truncated to the range, drawn by inverse CDF (so the tail is cut
/// off rather than piled up at the maximum).
fn longalign(rng: &mut StdRng) -> u64 {
    let span = (LONGALIGN_MAX - LONGALIGN_MIN) as f64;
    let kept = 1.0 - (-span / LONGALIGN_THETA).exp();
    let u: f64 = rng.random();
    let excess = -LONGALIGN_THETA * (1.0 - u * kept).ln();
    to_tokens(LONGALIGN_MIN as f64 + excess, LONGALIGN_MIN, LONGALIGN_MAX)
}

/// Lognormal, clamped: trajectories longer than the cap are cut at it.
fn swesmith(rng: &mut StdRng) -> u64 {
    let x = lognormal(rng, SWESMITH_MEDIAN, SWESMITH_SIGMA);
    to_tokens(x, SWESMITH_MIN, SWESMITH_MAX)
}

/// Uniform prompt + lognormal response, the total clamped at the maximum (truncated responses).
fn rl(rng: &mut StdRng) -> u64 {
    let prompt = rng.random_range(RL_PROMPT);
    let response = lognormal(rng, RL_RESPONSE_MEDIAN, RL_RESPONSE_SIGMA);
    to_tokens(prompt as f64 + response, *RL_PROMPT.start(), RL_MAX)
}

/// A lognormal draw with the given median and σ of the underlying normal.
fn lognormal(rng: &mut StdRng, median: f64, sigma: f64) -> f64 {
    let z: f64 = rng.sample(StandardNormal);
    median * (sigma * z).exp()
}

/// Rounds to whole tokens and clamps to `min..=max` (non-finite values go to the nearest bound).
fn to_tokens(x: f64, min: u64, max: u64) -> u64 {
    if x.is_nan() {
        return min;
    }
    (x.round().clamp(min as f64, max as f64)) as u64
}

/// Parses a list of sequence lengths: one positive integer per line.
///
/// Surrounding whitespace on each line is ignored; blank lines and lines whose first non-blank
/// character is `#` are skipped (comments must be on their own line). Anything else must be a
/// positive decimal integer of at most [`MAX_SEQUENCE_TOKENS`]; otherwise the result is
/// [`WorkloadError::BadLine`] with the 1-based line number. Input without any length gives
/// [`WorkloadError::Empty`].
///
/// ```
/// use odc_bench::workload::parse_lengths;
/// assert_eq!(parse_lengths("# lengths\n 100\n\n2048\n").unwrap(), vec![100, 2048]);
/// assert_eq!(parse_lengths("1\n2\nabc\n").unwrap_err().line(), Some(3));
/// assert_eq!(parse_lengths("1\n1000000000000\n").unwrap_err().line(), Some(2));
/// ```
pub fn parse_lengths(text: &str) -> Result<Vec<u64>, WorkloadError> {
    let mut lengths = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: &str| WorkloadError::BadLine {
            line: index + 1,
            text: line.to_string(),
            reason: reason.to_string(),
        };
        let too_long = || {
            bad(&format!(
                "longer than the maximum sequence length {MAX_SEQUENCE_TOKENS} tokens"
            ))
        };
        match line.parse::<u64>() {
            Ok(0) => return Err(bad("lengths must be positive")),
            Ok(len) if len > MAX_SEQUENCE_TOKENS => return Err(too_long()),
            Ok(len) => lengths.push(len),
            Err(e) => {
                return Err(match e.kind() {
                    std::num::IntErrorKind::PosOverflow => too_long(),
                    _ if is_negative_integer(line) => bad("lengths must be positive"),
                    _ => bad("not an integer"),
                });
            }
        }
    }
    if lengths.is_empty() {
        return Err(WorkloadError::Empty);
    }
    Ok(lengths)
}

/// `-` followed by one or more decimal digits.
fn is_negative_integer(s: &str) -> bool {
    s.strip_prefix('-')
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// Arithmetic mean of `lengths`; `0.0` for an empty slice.
pub fn mean(lengths: &[u64]) -> f64 {
    if lengths.is_empty() {
        return 0.0;
    }
    lengths.iter().map(|&l| l as f64).sum::<f64>() / lengths.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const N: usize = 20_000;
    const SEEDS: [u64; 3] = [0, 1, 12345];

    fn assert_mean_within(w: &Workload, target: f64, tolerance: f64) {
        for seed in SEEDS {
            let m = mean(&w.sample(N, seed));
            assert!(
                (m - target).abs() <= tolerance * target,
                "{} seed {seed}: mean {m} not within {tolerance} of {target}",
                w.name()
            );
        }
    }

    fn assert_range(w: &Workload, min: u64, max: u64) {
        let s = w.sample(N, 3);
        assert_eq!(s.len(), N);
        let lo = *s.iter().min().unwrap();
        let hi = *s.iter().max().unwrap();
        assert!(lo >= min && hi <= max, "{}: {lo}..={hi}", w.name());
    }

    #[test]
    fn longalign_mean_is_16_5k() {
        assert_mean_within(&Workload::LongAlign, 16_500.0, 0.05);
    }

    #[test]
    fn swesmith_mean_is_34_7k() {
        assert_mean_within(&Workload::SweSmith, 34_700.0, 0.05);
    }

    #[test]
    fn rl_mean_is_4_5k_and_within_3_5k_to_5_5k() {
        assert_mean_within(&Workload::Rl, 4_500.0, 0.05);
        let m = mean(&Workload::Rl.sample(N, 9));
        assert!((3_500.0..=5_500.0).contains(&m), "{m}");
    }

    #[test]
    fn longalign_respects_range_and_has_right_tail() {
        assert_range(&Workload::LongAlign, 8192, 65536);
        let s = Workload::LongAlign.sample(N, 4);
        // Heavy right tail: the mean sits well above the median, and some samples exceed 40K.
        let mut sorted = s.clone();
        sorted.sort_unstable();
        let median = sorted[N / 2] as f64;
        assert!(mean(&s) > median * 1.1, "mean {} median {median}", mean(&s));
        assert!(s.iter().any(|&x| x > 40_000));
    }

    #[test]
    fn swesmith_respects_range_and_cap() {
        assert_range(&Workload::SweSmith, 2048, 65536);
        assert!(Workload::SweSmith.sample(N, 5).contains(&65536));
    }

    #[test]
    fn rl_respects_range() {
        assert_range(&Workload::Rl, 256, 16384);
    }

    #[test]
    fn balanced_is_all_equal() {
        let w = Workload::from_name("balanced").unwrap();
        assert_eq!(w.sample(5, 1), vec![16384; 5]);
        assert_eq!(Workload::Balanced { tokens: 7 }.sample(3, 99), vec![7; 3]);
    }

    #[test]
    fn lengths_draws_only_given_values_deterministically() {
        let w = Workload::Lengths {
            name: "f".into(),
            lengths: vec![10, 20, 30],
        };
        let a = w.sample(1000, 11);
        assert!(a.iter().all(|x| [10, 20, 30].contains(x)));
        for v in [10, 20, 30] {
            assert!(a.contains(&v), "{v} never drawn");
        }
        assert_eq!(a, w.sample(1000, 11));
        assert_ne!(a, w.sample(1000, 12));
        let empty = Workload::Lengths {
            name: "e".into(),
            lengths: vec![],
        };
        assert!(empty.sample(10, 0).is_empty());
    }

    #[test]
    fn same_seed_same_lengths_different_seed_different_lengths() {
        for w in [Workload::LongAlign, Workload::SweSmith, Workload::Rl] {
            assert_eq!(w.sample(500, 42), w.sample(500, 42), "{}", w.name());
            assert_ne!(w.sample(500, 42), w.sample(500, 43), "{}", w.name());
            // A shorter draw is a prefix of a longer one with the same seed.
            assert_eq!(w.sample(10, 42)[..], w.sample(500, 42)[..10]);
        }
        assert!(Workload::Rl.sample(0, 1).is_empty());
    }

    #[test]
    fn names_round_trip_through_from_name() {
        for name in BUILTIN_NAMES {
            let w = Workload::from_name(name).unwrap();
            assert_eq!(w.name(), name);
        }
        assert_eq!(
            Workload::from_name(" LongAlign "),
            Some(Workload::LongAlign)
        );
        assert_eq!(Workload::from_name("nope"), None);
        assert_eq!(Workload::from_name(""), None);
    }

    #[test]
    fn parse_skips_blank_lines_comments_and_whitespace() {
        let text = "# header\n\n  100  \n\t2048\r\n   # indented comment\n65536\n\n";
        assert_eq!(parse_lengths(text).unwrap(), vec![100, 2048, 65536]);
        assert_eq!(parse_lengths("5").unwrap(), vec![5]);
    }

    #[test]
    fn parse_bad_line_reports_its_line_number() {
        let err = parse_lengths("100\n200\nabc\n300\n").unwrap_err();
        match &err {
            WorkloadError::BadLine { line, text, reason } => {
                assert_eq!(*line, 3);
                assert_eq!(text, "abc");
                assert_eq!(reason, "not an integer");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("line 3"), "{err}");
        // Blank and comment lines still count.
        let err = parse_lengths("# c\n\n1.5\n").unwrap_err();
        assert_eq!(err.line(), Some(3));
        assert_eq!(parse_lengths("12 34\n").unwrap_err().line(), Some(1));
        assert_eq!(
            parse_lengths("1\n100 # inline\n").unwrap_err().line(),
            Some(2)
        );
    }

    #[test]
    fn parse_rejects_zero() {
        let err = parse_lengths("10\n0\n").unwrap_err();
        assert!(
            matches!(&err, WorkloadError::BadLine { line: 2, reason, .. } if reason == "lengths must be positive"),
            "{err:?}"
        );
    }

    #[test]
    fn parse_rejects_negative() {
        let err = parse_lengths("-5\n").unwrap_err();
        assert!(
            matches!(&err, WorkloadError::BadLine { line: 1, text, reason } if text == "-5" && reason == "lengths must be positive"),
            "{err:?}"
        );
        assert!(err.to_string().contains("lengths must be positive"));
    }

    #[test]
    fn parse_rejects_lengths_above_the_maximum() {
        for text in [
            "1\n99999999999999999999999\n",
            "1\n10000000000000000000\n",
            "1\n1000000000000\n",
            "1\n1048577\n",
        ] {
            let err = parse_lengths(text).unwrap_err();
            assert!(
                matches!(&err, WorkloadError::BadLine { line: 2, reason, .. } if reason.contains("maximum sequence length 1048576")),
                "{text:?}: {err:?}"
            );
        }
        assert_eq!(
            parse_lengths("1048576\n").unwrap(),
            vec![MAX_SEQUENCE_TOKENS]
        );
    }

    #[test]
    fn parse_empty_input_is_an_error() {
        for text in ["", "\n\n", "# only a comment\n   \n"] {
            assert!(
                matches!(parse_lengths(text), Err(WorkloadError::Empty)),
                "{text:?}"
            );
        }
    }

    fn temp_path(name: &str) -> PathBuf {
        crate::test_util::temp_path("odc-workload", name)
    }

    #[test]
    fn from_file_reads_lengths_and_names_by_stem() {
        let dir = temp_path("dir");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mylens.txt");
        std::fs::write(&path, "# lengths\n100\n200\n").unwrap();
        let w = Workload::from_file(&path).unwrap();
        assert_eq!(
            w,
            Workload::Lengths {
                name: "mylens".into(),
                lengths: vec![100, 200]
            }
        );
        assert_eq!(w.name(), "mylens");

        std::fs::write(&path, "100\n200\n-3\n").unwrap();
        let err = Workload::from_file(&path).unwrap_err();
        assert_eq!(err.line(), Some(3));
        assert!(err.to_string().contains("mylens.txt"), "{err}");

        std::fs::write(&path, "\n# nothing\n").unwrap();
        let err = Workload::from_file(&path).unwrap_err();
        assert!(
            matches!(&err, WorkloadError::InFile { source, .. } if matches!(**source, WorkloadError::Empty)),
            "{err:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn from_file_missing_names_the_path() {
        let path = temp_path("does-not-exist.txt");
        let err = Workload::from_file(&path).unwrap_err();
        assert!(matches!(&err, WorkloadError::Io { path: p, .. } if p == &path));
        assert!(err.to_string().contains("does-not-exist.txt"), "{err}");
    }

    #[test]
    fn mean_of_empty_is_zero() {
        assert_eq!(mean(&[]), 0.0);
        assert_eq!(mean(&[1, 2, 3, 4]), 2.5);
    }

    proptest! {
        #[test]
        fn parse_of_joined_lengths_round_trips(lengths in prop::collection::vec(1u64..=MAX_SEQUENCE_TOKENS, 1..64)) {
            let text = lengths.iter().map(u64::to_string).collect::<Vec<_>>().join("\n");
            prop_assert_eq!(parse_lengths(&text).unwrap(), lengths.clone());
            // With surrounding whitespace, blank lines and CRLF as well.
            let noisy = lengths.iter().map(|l| format!("  {l}\t\r\n\n")).collect::<String>();
            prop_assert_eq!(parse_lengths(&noisy).unwrap(), lengths);
        }

        #[test]
        fn parse_never_panics(text in ".{0,200}") {
            let _ = parse_lengths(&text);
        }
    }
}
