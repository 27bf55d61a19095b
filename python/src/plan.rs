//! `odc.balance` in plain Rust: a minibatch's lengths planned over ranks as the runtime plans
//! them (odc-policy's balancer and splitter), and a cost model fitted to a measured table.
//!
//! - [`Dispatch::Static`] is ODC's LB-Mini (`plan_static`): each rank's share balanced by cost,
//!   packed into as few micro-batches of even cost as the budget allows; counts may differ.
//! - [`Dispatch::Dynamic`] packs each share in decreasing sizes (`plan_dynamic`): the lists a work
//!   queue starts from, the small micro-batches last so that idle ranks can take them.
//! - [`Dispatch::Equal`] is LB-Micro (`plan_equal_count`): every rank the same number of
//!   micro-batches, what a collective (FSDP) needs.
//! - [`Split`]: long samples cut over gangs of ranks (zig-zag halves, as context parallelism cuts
//!   them) where the splitter finds that it shortens the step, through the runtime's own
//!   options and lists (`odc_policy::split::{runtime_options, on_demand_lists}`); each member's
//!   piece is a micro-batch of its own, first on its rank's list.
//! - [`fit`]: `a·ŝ² + b·ŝ` by least squares over a measured `(tokens, cost)` table, both
//!   coefficients non-negative (the balancer's model is monotone).
//!
//! Invariants (tested below): every sample is in exactly one micro-batch or, split, in one piece
//! per member of its gang whose token ranges cover it exactly once; every micro-batch of whole
//! samples holds at most the budget; every rank's list names its micro-batches once.

use std::ops::Range;
use std::str::FromStr;

use odc_policy::balancer::{
    plan_dynamic, plan_equal_count, plan_static, BalanceError, CostModel, Plan,
};
use odc_policy::split::{self, SplitError};

/// How micro-batches are handed to ranks (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    Static,
    Dynamic,
    Equal,
}

impl FromStr for Dispatch {
    type Err = String;

    /// `static`, `dynamic` or `equal`.
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "static" => Ok(Dispatch::Static),
            "dynamic" => Ok(Dispatch::Dynamic),
            "equal" => Ok(Dispatch::Equal),
            other => Err(format!(
                "dispatch {other:?}: expected \"static\", \"dynamic\" or \"equal\""
            )),
        }
    }
}

/// Which samples may be split, over gangs of how many ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Split {
    /// Samples shorter than this are never split.
    pub min_tokens: u64,
    /// The most ranks in a gang (0: every rank).
    pub max_gang: u32,
}

/// One member's piece of a split sample: its two zig-zag token ranges of the sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The sample (index into the lengths).
    pub sample: usize,
    /// This member, and every member's rank in member order (the ring's order).
    pub member: u32,
    pub ranks: Vec<u32>,
    /// Chunks `member` and `2k − 1 − member` of the sample's `2k` near-equal chunks.
    pub chunks: [Range<u64>; 2],
}

/// A planned minibatch: the plan (a split sample's pieces are micro-batches without samples),
/// and for each micro-batch its piece, if it is one.
#[derive(Debug, Clone, PartialEq)]
pub struct Balanced {
    pub plan: Plan,
    pub pieces: Vec<Option<Piece>>,
}

/// Why a minibatch cannot be planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Balance(#[from] BalanceError),
    #[error("sequence splitting: {0}")]
    Split(#[from] SplitError),
    #[error(
        "splitting needs dispatch \"static\" or \"dynamic\": with \"equal\" (a collective's \
         lockstep) it is context parallelism, which odc.balance does not plan"
    )]
    SplitWithEqual,
}

/// The plan of `lengths` (tokens per sample) over `ranks` under `token_budget` tokens per
/// micro-batch, priced by `cost`, long samples split where `split` allows and it pays.
pub fn plan(
    lengths: &[u64],
    ranks: usize,
    token_budget: u64,
    cost: &CostModel,
    dispatch: Dispatch,
    split: Option<Split>,
) -> Result<Balanced, PlanError> {
    cost.validate()?;
    let whole = || -> Result<Plan, BalanceError> {
        match dispatch {
            Dispatch::Static => plan_static(lengths, cost, ranks, token_budget),
            Dispatch::Dynamic => plan_dynamic(lengths, cost, ranks, token_budget),
            Dispatch::Equal => plan_equal_count(lengths, cost, ranks, token_budget),
        }
    };
    let Some(split) = split else {
        return Ok(unsplit(whole()?));
    };
    if dispatch == Dispatch::Equal {
        return Err(PlanError::SplitWithEqual);
    }
    let devices = u32::try_from(ranks).unwrap_or(u32::MAX);
    let (costs, options) = split::runtime_options(
        *cost,
        devices,
        split.max_gang,
        None,
        token_budget,
        split.min_tokens,
    );
    let planned = split::plan(lengths, &costs, options)?;
    // As the runtime: splitting only where it shortens the whole-sample plan's step, or where
    // no whole-sample plan exists (a sample over the budget whose pieces fit).
    match whole() {
        Ok(plan) if planned.gangs.is_empty() || planned.step_s >= max_cost(&plan) => {
            Ok(unsplit(plan))
        }
        _ => assemble(lengths, cost, &planned),
    }
}

fn unsplit(plan: Plan) -> Balanced {
    let pieces = vec![None; plan.micro_batches.len()];
    Balanced { plan, pieces }
}

fn max_cost(plan: &Plan) -> f64 {
    plan.trainer_costs().into_iter().fold(0.0, f64::max)
}

/// The split plan as the runtime runs it on demand ([`split::on_demand_lists`]): on each rank
/// its gangs' pieces first, then its micro-batches of whole samples.
fn assemble(
    lengths: &[u64],
    cost: &CostModel,
    planned: &split::SplitPlan,
) -> Result<Balanced, PlanError> {
    let (plan, members) = split::on_demand_lists(lengths, cost, planned)?;
    let pieces = members
        .into_iter()
        .map(|m| {
            m.map(|m| {
                let gang = &planned.gangs[m.gang];
                Piece {
                    sample: gang.sample,
                    member: m.member,
                    ranks: gang.devices.clone(),
                    chunks: m.chunks,
                }
            })
        })
        .collect();
    Ok(Balanced { plan, pieces })
}

/// The cost model `a·ŝ² + b·ŝ` (`ŝ = tokens / scale`) closest to the measured `costs` of
/// samples of `lengths` tokens in least squares, with `a, b ≥ 0`; an error names what is wrong
/// with the table (lengths and costs of different counts, fewer than two distinct lengths, a
/// zero length, a cost that is negative or not finite).
pub fn fit(lengths: &[u64], costs: &[f64], scale: f64) -> Result<CostModel, String> {
    if lengths.len() != costs.len() {
        return Err(format!(
            "a cost table needs one cost per length: {} lengths, {} costs",
            lengths.len(),
            costs.len()
        ));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return Err(format!("scale must be positive, got {scale}"));
    }
    if let Some(i) = lengths.iter().position(|&l| l == 0) {
        return Err(format!("length {i} of the cost table is zero"));
    }
    if let Some(i) = costs.iter().position(|c| !(c.is_finite() && *c >= 0.0)) {
        return Err(format!(
            "cost {i} of the cost table is {}: costs are finite and non-negative",
            costs[i]
        ));
    }
    let mut distinct = lengths.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return Err("a cost table needs at least two different lengths to fit a and b".into());
    }
    // Normal equations of min Σ (a·s² + b·s − c)² over s = length / scale.
    let (mut s2, mut s3, mut s4, mut cs, mut cs2) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (&l, &c) in lengths.iter().zip(costs) {
        let s = l as f64 / scale;
        s2 += s * s;
        s3 += s * s * s;
        s4 += s * s * s * s;
        cs += c * s;
        cs2 += c * s * s;
    }
    let det = s4 * s2 - s3 * s3;
    let (mut a, mut b) = ((cs2 * s2 - cs * s3) / det, (s4 * cs - s3 * cs2) / det);
    // The best fit with a coefficient held at zero where the free one is negative.
    if a < 0.0 {
        (a, b) = (0.0, cs / s2);
    } else if b < 0.0 {
        (a, b) = (cs2 / s4, 0.0);
    }
    let model = CostModel {
        scale,
        ..CostModel::quadratic(a, b)
    };
    model.validate().map_err(|e| e.to_string())?;
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENGTHS: [u64; 8] = [40_000, 9_000, 12_000, 30_000, 5_000, 22_000, 700, 64_000];

    /// Every sample once (whole, or its pieces covering it exactly once), every whole
    /// micro-batch within the budget, every rank's list naming its micro-batches once.
    fn assert_covers(b: &Balanced, lengths: &[u64], ranks: usize, budget: u64) {
        let mbs = &b.plan.micro_batches;
        assert_eq!(b.pieces.len(), mbs.len());
        assert_eq!(b.plan.per_trainer.len(), ranks);
        let mut listed: Vec<usize> = b.plan.per_trainer.concat();
        listed.sort_unstable();
        assert_eq!(listed, (0..mbs.len()).collect::<Vec<_>>());
        let mut covered = vec![0u64; lengths.len()];
        for (mb, piece) in mbs.iter().zip(&b.pieces) {
            match piece {
                None => {
                    assert!(mb.tokens <= budget && !mb.samples.is_empty());
                    for &s in &mb.samples {
                        covered[s] += lengths[s];
                    }
                }
                Some(p) => {
                    assert!(mb.samples.is_empty());
                    let held: u64 = p.chunks.iter().map(|r| r.end - r.start).sum();
                    assert_eq!(held, mb.tokens);
                    covered[p.sample] += held;
                }
            }
        }
        assert_eq!(covered, lengths);
    }

    #[test]
    fn dispatch_words_and_a_bad_one_named() {
        assert_eq!("static".parse::<Dispatch>(), Ok(Dispatch::Static));
        assert_eq!("dynamic".parse::<Dispatch>(), Ok(Dispatch::Dynamic));
        assert_eq!("equal".parse::<Dispatch>(), Ok(Dispatch::Equal));
        let e = "lb-mini".parse::<Dispatch>().unwrap_err();
        assert!(e.contains("\"lb-mini\"") && e.contains("\"static\""), "{e}");
    }

    #[test]
    fn every_dispatch_places_every_sample_once_within_the_budget() {
        for dispatch in [Dispatch::Static, Dispatch::Dynamic, Dispatch::Equal] {
            let b = plan(&LENGTHS, 3, 65_536, &CostModel::default(), dispatch, None).unwrap();
            assert_covers(&b, &LENGTHS, 3, 65_536);
            assert!(b.pieces.iter().all(Option::is_none), "{dispatch:?}");
        }
        let equal = plan(
            &LENGTHS,
            3,
            65_536,
            &CostModel::default(),
            Dispatch::Equal,
            None,
        );
        let counts: Vec<usize> = equal
            .unwrap()
            .plan
            .per_trainer
            .iter()
            .map(Vec::len)
            .collect();
        assert!(counts.iter().all(|&c| c == counts[0]), "{counts:?}");
    }

    #[test]
    fn a_long_sample_is_split_where_it_shortens_the_step_and_its_pieces_cover_it() {
        // One sample far costlier than the rest: whole, its rank alone sets the step.
        let lengths = [64_000, 2_000, 2_000, 2_000, 2_000, 2_000, 2_000, 2_000];
        let cost = CostModel::default();
        let whole = plan(&lengths, 4, 65_536, &cost, Dispatch::Static, None).unwrap();
        let some = Some(Split::default());
        let split = plan(&lengths, 4, 65_536, &cost, Dispatch::Static, some).unwrap();
        assert_covers(&split, &lengths, 4, 65_536);
        let pieces: Vec<&Piece> = split.pieces.iter().flatten().collect();
        assert!(pieces.len() >= 2 && pieces.iter().all(|p| p.sample == 0));
        let k = pieces.len() as u32;
        for (m, p) in pieces.iter().enumerate() {
            assert_eq!((p.member, p.ranks.len() as u32), (m as u32, k));
            // A member's piece is first on its rank's list.
            let rank = p.ranks[m] as usize;
            let first = split.plan.per_trainer[rank][0];
            assert_eq!(split.pieces[first].as_ref(), Some(*p));
        }
        assert!(max_cost(&split.plan) < max_cost(&whole.plan));
        // Balanced lengths: nothing worth splitting, the whole-sample plan unchanged.
        let even = [8_000; 8];
        let kept = plan(&even, 4, 65_536, &cost, Dispatch::Static, some).unwrap();
        assert_eq!(
            kept,
            plan(&even, 4, 65_536, &cost, Dispatch::Static, None).unwrap()
        );
        // Not below the floor asked for.
        let floor = Some(Split {
            min_tokens: 100_000,
            max_gang: 0,
        });
        let none = plan(&lengths, 4, 65_536, &cost, Dispatch::Static, floor).unwrap();
        assert_eq!(none, whole);
    }

    #[test]
    fn a_sample_over_the_budget_is_split_into_pieces_within_it_or_refused_by_name() {
        let lengths = [100_000, 3_000, 3_000];
        let cost = CostModel::default();
        let e = plan(&lengths, 2, 65_536, &cost, Dispatch::Static, None).unwrap_err();
        assert!(e.to_string().contains("100000"), "{e}");
        let some = Some(Split::default());
        let b = plan(&lengths, 2, 65_536, &cost, Dispatch::Dynamic, some).unwrap();
        assert_covers(&b, &lengths, 2, 65_536);
        assert!(b.plan.micro_batches.iter().all(|mb| mb.tokens <= 65_536));
        let one = Some(Split {
            min_tokens: 0,
            max_gang: 1,
        });
        let e = plan(&lengths, 2, 65_536, &cost, Dispatch::Static, one).unwrap_err();
        assert!(e.to_string().contains("sample 0 has 100000 tokens"), "{e}");
        let e = plan(&lengths, 2, 65_536, &cost, Dispatch::Equal, some).unwrap_err();
        assert_eq!(e, PlanError::SplitWithEqual);
    }

    #[test]
    fn a_fit_recovers_the_model_a_table_was_made_with() {
        let truth = CostModel::quadratic(4.0, 9.0);
        let lengths = [1_000u64, 4_000, 16_000, 32_000, 64_000];
        let costs: Vec<f64> = lengths.iter().map(|&l| truth.cost(l)).collect();
        let got = fit(&lengths, &costs, 32_000.0).unwrap();
        assert!(
            (got.a - 4.0).abs() < 1e-9 && (got.b - 9.0).abs() < 1e-9,
            "{got:?}"
        );
        // A table no quadratic with a ≥ 0 fits: the best linear one.
        let concave = [1.0, 1.9, 2.7];
        let got = fit(&[32_000, 64_000, 96_000], &concave, 32_000.0).unwrap();
        assert_eq!(got.a, 0.0);
        assert!(got.b > 0.0);
        for (lengths, costs, says) in [
            (vec![1_000, 2_000], vec![1.0], "one cost per length"),
            (vec![1_000, 1_000], vec![1.0, 1.0], "two different lengths"),
            (vec![0, 1_000], vec![1.0, 2.0], "length 0"),
            (vec![1_000, 2_000], vec![1.0, f64::NAN], "cost 1"),
        ] {
            let e = fit(&lengths, &costs, 32_000.0).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}
