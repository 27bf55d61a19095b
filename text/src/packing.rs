//! Problems as training samples, packed into rows of at most a token budget.
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Prompt masked**: a [`Sample`] of a problem is `BOS question \n answer EOS` (no BOS when
//!    the tokenizer has none); its loss mask is false on every prompt token (`BOS question \n`)
//!    and true on every answer token and the EOS. (A conversation in a model's chat format is
//!    [`Sample::from_chat`], in [`super::chat`].)
//! 2. **In order, nothing lost**: [`pack`] places the samples in their order, each whole in one
//!    row, so the rows' tokens, masks and lengths concatenate to the input's.
//! 3. **Within budget**: no row holds more than the budget; a sample longer than the budget is
//!    [`TextError::OverBudget`] naming its index (nothing is truncated: cut or drop such samples
//!    before packing, where the choice of what to lose is visible).
//! 4. **Isolated**: within a row, positions restart at 0 at each sample and segment ids change
//!    exactly at sample boundaries, so attention can be kept within a sample.
//!
//! [`sample_metas`] gives each sample's real length to odc's balancer as a [`SampleMeta`].

use std::ops::Range;

use odc_policy::batch::SampleMeta;

use super::problem::Problem;
use super::tokenizer::Tokenizer;
use super::TextError;

/// One training sequence and where its loss counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    tokens: Vec<u32>,
    loss_mask: Vec<bool>,
}

impl Sample {
    /// A sample from its tokens and per-token loss mask, which must be equally long and not empty.
    pub fn new(tokens: Vec<u32>, loss_mask: Vec<bool>) -> Result<Self, TextError> {
        if tokens.is_empty() || tokens.len() != loss_mask.len() {
            return Err(TextError::SampleShape {
                tokens: tokens.len(),
                mask: loss_mask.len(),
            });
        }
        Ok(Sample { tokens, loss_mask })
    }

    /// `BOS question \n answer EOS` (BOS when the tokenizer has one), with loss on the answer and
    /// EOS only; the tokenizer's error if it cannot encode the text.
    ///
    /// ```
    /// use odc_text::{ByteTokenizer, Problem, Sample};
    /// let p = Problem { question: "1+1?".into(), answer: "#### 2".into() };
    /// let s = Sample::from_problem(&ByteTokenizer, &p)?;
    /// assert_eq!(s.len(), 1 + 4 + 1 + 6 + 1);
    /// assert_eq!(s.loss_tokens(), 6 + 1);
    /// # Ok::<(), odc_text::TextError>(())
    /// ```
    pub fn from_problem(tokenizer: &dyn Tokenizer, problem: &Problem) -> Result<Self, TextError> {
        let mut tokens = prompt_tokens(tokenizer, &problem.question)?;
        let prompt = tokens.len();
        tokens.extend(tokenizer.encode(&problem.answer)?);
        tokens.push(tokenizer.eos());
        let mut loss_mask = vec![false; tokens.len()];
        loss_mask[prompt..].fill(true);
        Ok(Sample { tokens, loss_mask })
    }

    /// The token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether each token's prediction counts toward the loss.
    pub fn loss_mask(&self) -> &[bool] {
        &self.loss_mask
    }

    /// Its length in tokens (never 0).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a sample has at least one token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// How many tokens carry loss.
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }

    /// This sample as odc sees it: dataset index `index`, its length and its loss tokens.
    pub fn meta(&self, index: u64) -> SampleMeta {
        SampleMeta {
            index,
            tokens: self.len() as u64,
            loss_tokens: self.loss_tokens() as u64,
        }
    }
}

/// The prompt a model continues to answer `question`: `BOS question \n`, BOS only when the
/// tokenizer has one (what [`Sample::from_problem`] masks out of the loss); the tokenizer's error
/// if it cannot encode it.
pub fn prompt_tokens(tokenizer: &dyn Tokenizer, question: &str) -> Result<Vec<u32>, TextError> {
    let mut tokens: Vec<u32> = tokenizer.bos().into_iter().collect();
    tokens.extend(tokenizer.encode(question)?);
    tokens.extend(tokenizer.encode("\n")?);
    Ok(tokens)
}

/// The first `n` of `problems` whose training sample ([`Sample::from_problem`]) is at most
/// `max_len` tokens: those a model with that context trains on and can answer whole (training
/// skips the others, so evaluating on them would count questions it never saw the like of).
///
/// ```
/// use odc_text::{fitting, ArithTask, ByteTokenizer, Sample};
/// let short = fitting(&ByteTokenizer, ArithTask::eval(0).problems(0..1_000), 300, 20)?;
/// assert_eq!(short.len(), 20);
/// for p in &short {
///     assert!(Sample::from_problem(&ByteTokenizer, p)?.len() <= 300);
/// }
/// # Ok::<(), odc_text::TextError>(())
/// ```
pub fn fitting(
    tokenizer: &dyn Tokenizer,
    problems: impl IntoIterator<Item = Problem>,
    max_len: usize,
    n: usize,
) -> Result<Vec<Problem>, TextError> {
    fitting_as(problems, max_len, n, |p| Sample::from_problem(tokenizer, p))
}

/// [`fitting`] with each problem's training sample made by `sample` (e.g.
/// [`TextFormat::problem_sample`](super::TextFormat::problem_sample)).
pub fn fitting_as(
    problems: impl IntoIterator<Item = Problem>,
    max_len: usize,
    n: usize,
    sample: impl Fn(&Problem) -> Result<Sample, TextError>,
) -> Result<Vec<Problem>, TextError> {
    let mut out = Vec::with_capacity(n);
    for problem in problems {
        if out.len() == n {
            break;
        }
        if sample(&problem)?.len() <= max_len {
            out.push(problem);
        }
    }
    Ok(out)
}

/// Each sample's [`SampleMeta`], indexed by its position in `samples`.
pub fn sample_metas(samples: &[Sample]) -> Vec<SampleMeta> {
    samples
        .iter()
        .enumerate()
        .map(|(i, s)| s.meta(i as u64))
        .collect()
}

/// A row of whole samples, placed one after another.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Packed {
    /// The samples' tokens, concatenated.
    pub tokens: Vec<u32>,
    /// Each token's position within its own sample (0 at each sample's first token).
    pub positions: Vec<u32>,
    /// Each token's sample within this row (0, 1, …), for attention isolation.
    pub segment_ids: Vec<u32>,
    /// The samples' loss masks, concatenated.
    pub loss_mask: Vec<bool>,
    /// Each sample's length, in order.
    pub sample_lengths: Vec<usize>,
    /// The indices of the input samples this row holds.
    pub samples: Range<usize>,
}

impl Packed {
    fn starting_at(index: usize) -> Self {
        Packed {
            samples: index..index,
            ..Packed::default()
        }
    }

    fn push(&mut self, sample: &Sample) {
        let segment = self.sample_lengths.len() as u32;
        self.tokens.extend_from_slice(&sample.tokens);
        self.positions.extend(0..sample.len() as u32);
        self.segment_ids
            .extend(std::iter::repeat_n(segment, sample.len()));
        self.loss_mask.extend_from_slice(&sample.loss_mask);
        self.sample_lengths.push(sample.len());
        self.samples.end += 1;
    }
}

/// Packs `samples` in order into rows of at most `budget_tokens` tokens, starting a new row when
/// the next sample does not fit.
///
/// ```
/// use odc_text::{pack, Sample};
/// let s = |n: usize| Sample::new(vec![1; n], vec![true; n]).unwrap();
/// let rows = pack(&[s(3), s(4), s(2)], 7).unwrap();
/// assert_eq!(rows[0].sample_lengths, vec![3, 4]);
/// assert_eq!(rows[1].positions, vec![0, 1]);
/// assert!(pack(&[s(8)], 7).is_err());
/// ```
pub fn pack(samples: &[Sample], budget_tokens: usize) -> Result<Vec<Packed>, TextError> {
    let mut rows = Vec::new();
    let mut row = Packed::starting_at(0);
    for (index, sample) in samples.iter().enumerate() {
        if sample.len() > budget_tokens {
            return Err(TextError::OverBudget {
                index,
                tokens: sample.len(),
                budget: budget_tokens,
            });
        }
        if row.tokens.len() + sample.len() > budget_tokens {
            rows.push(std::mem::replace(&mut row, Packed::starting_at(index)));
        }
        row.push(sample);
    }
    if !row.tokens.is_empty() {
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArithTask, ByteTokenizer};
    use proptest::prelude::*;

    fn samples(n: u64) -> Vec<Sample> {
        ArithTask::train(2)
            .problems(0..n)
            .map(|p| Sample::from_problem(&ByteTokenizer, &p).expect("bytes never fail"))
            .collect()
    }

    #[test]
    fn prompt_masked_false_on_every_prompt_token_true_on_every_answer_token() {
        let t = ByteTokenizer;
        for p in ArithTask::train(2).problems(0..200) {
            let s = Sample::from_problem(&t, &p).expect("bytes never fail");
            let prompt = prompt_tokens(&t, &p.question).expect("bytes never fail");
            let answer = t.encode(&p.answer).expect("bytes never fail");
            assert_eq!(s.len(), prompt.len() + answer.len() + 1);
            assert_eq!(&s.tokens()[..prompt.len()], &prompt[..]);
            assert_eq!(Some(s.tokens()[0]), t.bos());
            assert_eq!(s.tokens()[prompt.len() - 1], u32::from(b'\n'));
            assert_eq!(&s.tokens()[prompt.len()..s.len() - 1], &answer[..]);
            assert_eq!(s.tokens()[s.len() - 1], t.eos());
            assert!(s.loss_mask()[..prompt.len()].iter().all(|&m| !m));
            assert!(s.loss_mask()[prompt.len()..].iter().all(|&m| m));
            assert_eq!(s.loss_tokens(), answer.len() + 1);
            let meta = s.meta(5);
            assert_eq!(
                (meta.index, meta.tokens, meta.loss_tokens),
                (5, s.len() as u64, s.loss_tokens() as u64)
            );
        }
    }

    /// The byte tokenizer without a BOS, as Qwen's tokenizer is.
    struct NoBos;

    impl Tokenizer for NoBos {
        fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
            ByteTokenizer.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
            ByteTokenizer.decode(ids)
        }
        fn vocab_size(&self) -> usize {
            ByteTokenizer.vocab_size()
        }
        fn bos(&self) -> Option<u32> {
            None
        }
        fn eos(&self) -> u32 {
            ByteTokenizer.eos()
        }
        fn pad(&self) -> u32 {
            ByteTokenizer.pad()
        }
    }

    #[test]
    fn prompt_masked_without_a_bos_the_sample_starts_with_the_question() {
        let p = Problem {
            question: "1+1?".into(),
            answer: "#### 2".into(),
        };
        assert_eq!(
            prompt_tokens(&NoBos, &p.question).expect("bytes"),
            b"1+1?\n".map(u32::from)
        );
        let s = Sample::from_problem(&NoBos, &p).expect("bytes never fail");
        assert_eq!(s.len(), 5 + 6 + 1);
        assert_eq!(s.tokens()[0], u32::from(b'1'));
        assert_eq!(s.loss_tokens(), 6 + 1);
    }

    #[test]
    fn sample_metas_carry_each_samples_real_length() {
        let samples = samples(50);
        let metas = sample_metas(&samples);
        assert_eq!(metas.len(), 50);
        for (i, (meta, s)) in metas.iter().zip(&samples).enumerate() {
            assert_eq!(meta.index, i as u64);
            assert_eq!(meta.tokens, s.len() as u64);
            assert!(meta.loss_tokens < meta.tokens);
        }
        let lengths: std::collections::HashSet<u64> = metas.iter().map(|m| m.tokens).collect();
        assert!(lengths.len() > 20, "lengths vary: {lengths:?}");
    }

    #[test]
    fn sample_shape_mismatch_or_empty_is_refused() {
        assert!(matches!(
            Sample::new(vec![1, 2], vec![true]),
            Err(TextError::SampleShape { tokens: 2, mask: 1 })
        ));
        assert!(matches!(
            Sample::new(vec![], vec![]),
            Err(TextError::SampleShape { tokens: 0, mask: 0 })
        ));
    }

    #[test]
    fn within_budget_an_oversized_sample_is_an_error_naming_it() {
        let s = |n: usize| Sample::new(vec![7; n], vec![false; n]).expect("valid");
        let err = pack(&[s(3), s(9), s(2)], 8).expect_err("9 > 8");
        assert!(matches!(
            err,
            TextError::OverBudget {
                index: 1,
                tokens: 9,
                budget: 8
            }
        ));
        assert_eq!(
            err.to_string(),
            "sample 1 has 9 tokens, over the packing budget of 8"
        );
        assert!(pack(&[s(1)], 0).is_err());
        assert_eq!(pack(&[], 0).expect("nothing to pack"), vec![]);
        // Exactly the budget fits.
        assert_eq!(pack(&[s(8), s(8)], 8).expect("fits").len(), 2);
    }

    /// Checks guarantees 2–4 for `rows` packed from `samples` under `budget`.
    fn check_rows(samples: &[Sample], rows: &[Packed], budget: usize) {
        let mut next = 0;
        for row in rows {
            let n = row.tokens.len();
            assert!(n <= budget && n > 0, "row of {n} tokens, budget {budget}");
            assert_eq!(row.positions.len(), n);
            assert_eq!(row.segment_ids.len(), n);
            assert_eq!(row.loss_mask.len(), n);
            assert_eq!(row.sample_lengths.iter().sum::<usize>(), n);
            assert_eq!(row.samples.start, next, "in order");
            next = row.samples.end;
            let mut at = 0;
            for (segment, (i, &len)) in row.samples.clone().zip(&row.sample_lengths).enumerate() {
                let sample = &samples[i];
                assert_eq!(len, sample.len());
                assert_eq!(&row.tokens[at..at + len], sample.tokens());
                assert_eq!(&row.loss_mask[at..at + len], sample.loss_mask());
                let positions: Vec<u32> = (0..len as u32).collect();
                assert_eq!(
                    &row.positions[at..at + len],
                    &positions[..],
                    "reset per sample"
                );
                assert!(row.segment_ids[at..at + len]
                    .iter()
                    .all(|&id| id == segment as u32));
                at += len;
            }
            // Segment ids change exactly where a new sample starts (where the position is 0).
            for k in 1..n {
                let changed = row.segment_ids[k] != row.segment_ids[k - 1];
                assert_eq!(changed, row.positions[k] == 0, "token {k}");
            }
        }
        assert_eq!(next, samples.len(), "every sample packed once");
        // A row is closed only when the next sample would not fit.
        for pair in rows.windows(2) {
            assert!(pair[0].tokens.len() + pair[1].sample_lengths[0] > budget);
        }
        let total: usize = samples.iter().map(Sample::len).sum();
        assert_eq!(rows.iter().map(|r| r.tokens.len()).sum::<usize>(), total);
    }

    #[test]
    fn in_order_nothing_lost_isolated_within_budget_on_arith_samples() {
        let samples = samples(300);
        let longest = samples.iter().map(Sample::len).max().expect("samples");
        for budget in [longest, 2_048, 4_096] {
            let rows = pack(&samples, budget).expect("every sample fits");
            check_rows(&samples, &rows, budget);
        }
    }

    proptest! {
        #[test]
        fn in_order_nothing_lost_isolated_within_budget_for_any_lengths(
            lengths in proptest::collection::vec(1usize..40, 0..40),
            slack in 0usize..60,
        ) {
            let samples: Vec<Sample> = lengths
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let mask = (0..n).map(|k| (k + i) % 3 == 0).collect();
                    Sample::new(vec![i as u32; n], mask).expect("valid")
                })
                .collect();
            let budget = lengths.iter().copied().max().unwrap_or(1) + slack;
            let rows = pack(&samples, budget).expect("every sample fits");
            check_rows(&samples, &rows, budget);
        }
    }
}
