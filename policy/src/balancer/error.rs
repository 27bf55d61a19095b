//! Errors of the balancer: every variant names the sample, budget or field that was wrong.

/// Why a minibatch could not be planned. Variants carry the offending sample index (an index into
/// the minibatch's `tokens` slice) and the values involved, so the caller can report it precisely.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum BalanceError {
    /// The minibatch has no samples.
    #[error("the minibatch has no samples")]
    EmptyMinibatch,
    /// A plan over zero trainers was requested.
    #[error("cannot plan a minibatch over zero trainers")]
    ZeroTrainers,
    /// More trainers than a plan supports ([`MAX_TRAINERS`](super::MAX_TRAINERS)); a plan holds
    /// one list per trainer, so an absurd count would exhaust memory.
    #[error("cannot plan a minibatch over {trainers} trainers; at most {max} are supported")]
    TooManyTrainers {
        /// The requested number of trainers.
        trainers: u64,
        /// The supported maximum.
        max: u64,
    },
    /// The micro-batch token budget is zero.
    #[error("the micro-batch token budget is zero")]
    ZeroBudget,
    /// One sample alone is longer than the micro-batch token budget, so no micro-batch can hold it.
    #[error("sample {sample} has {tokens} tokens, more than the micro-batch budget of {budget}")]
    SampleExceedsBudget {
        /// Index of the sample in the minibatch.
        sample: u64,
        /// Its length in tokens.
        tokens: u64,
        /// The micro-batch token budget.
        budget: u64,
    },
    /// A sample has zero tokens.
    #[error("sample {sample} has zero tokens")]
    ZeroLength {
        /// Index of the sample in the minibatch.
        sample: u64,
    },
    /// A sample index passed to [`pack`](super::pack) is not an index into `tokens`.
    #[error("sample index {sample} is out of range for a minibatch of {len} samples")]
    SampleOutOfRange {
        /// The out-of-range index.
        sample: u64,
        /// Number of samples in the minibatch.
        len: u64,
    },
    /// A sample index was passed to [`pack`](super::pack) more than once.
    #[error("sample {sample} is listed more than once")]
    DuplicateSample {
        /// The repeated index.
        sample: u64,
    },
    /// The cost model gave a non-finite (infinite or NaN) cost for a sample.
    #[error("the cost model gives sample {sample} of {tokens} tokens the non-finite cost {cost}")]
    NonFiniteCost {
        /// Index of the sample in the minibatch.
        sample: u64,
        /// Its length in tokens.
        tokens: u64,
        /// The cost computed for it.
        cost: f64,
    },
    /// Every sample cost is finite but their sum is not, so micro-batch and trainer costs would be.
    #[error("the sample costs of the minibatch sum to the non-finite value {total}")]
    CostOverflow {
        /// The sum of all sample costs.
        total: f64,
    },
    /// A trainer's speed (for [`plan_static_weighted`](super::plan_static_weighted)) is not
    /// finite and positive, so its share of the work is undefined.
    #[error("trainer {trainer} has speed {speed}; speeds must be finite and positive")]
    InvalidSpeed {
        /// Index of the trainer in the `speeds` slice.
        trainer: u64,
        /// The speed given for it.
        speed: f64,
    },
    /// A cost model coefficient is negative or not finite, or its scale is not positive.
    #[error("cost model field `{field}` is {value}; it must be finite and {requirement}")]
    InvalidCostModel {
        /// Name of the field (`a`, `b` or `scale`).
        field: String,
        /// Its value.
        value: f64,
        /// What it must satisfy besides being finite.
        requirement: String,
    },
}
