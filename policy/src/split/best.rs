//! On-demand training's plan for a step with long samples: the best of the splitting planner's
//! gangs ([`super::plan`]) and the context-parallel placements a collective would run
//! ([`super::plan_cp`]), the latter run without lockstep ([`super::unlocked_step_s`]).
//!
//! On demand a trainer never waits for a round: a CP placement runs as each trainer's list of
//! cells, and only the trainers a gang ties together meet. So whatever a CP collective can plan,
//! on-demand training can run at least as fast, and the planner takes it where it is shorter
//! than its own gangs: static CP of every group size of 2 to 64 (at most `max_gang`) that
//! divides the trainers, and dynamic CP with groups of up to `max_gang` — where it shortens the
//! step by more than [`CP_MARGIN`], so that a placement that only evens out the rounding of whole
//! samples stays out. Splitting every sample is only worth weighing where its exchange has a
//! price: with costs that price no ring ([`SplitCosts::prices_ring`]: a job without a
//! [`super::RingPrice`]) every split would look free, and only the gangs' plan is made; so too
//! with [`SplitOptions::min_tokens`] above 0 (a sample under it must stay whole) or splitting off.
//!
//! Guarantees (tested): the chosen step is never above the gangs' plan's, and a CP placement is
//! chosen only below `(1 − CP_MARGIN)` of it, and never with an unpriced ring; deterministic.
//!
//! The runtime's on-demand steps plan with it (`StepMachine`'s splitting), the CP placement's
//! trainers being the live ones.

use super::cost::SplitCosts;
use super::cp::{plan_cp, static_cp_sizes, unlocked_step_s, ContextParallel, CpPlan};
use super::plan::{plan, SplitOptions, SplitPlan};
use super::SplitError;

/// The fraction of the gangs' step a CP placement must save to replace it.
pub const CP_MARGIN: f64 = 0.02;

/// The plan an on-demand step runs.
#[derive(Debug, Clone, PartialEq)]
pub enum OnDemandPlan {
    /// The splitting planner's: gangs placed first, whole samples packed after.
    Gangs(SplitPlan),
    /// A context-parallel placement, each trainer's cells in round order, without lockstep.
    Rounds {
        cp: ContextParallel,
        plan: CpPlan,
        step_s: f64,
    },
}

impl OnDemandPlan {
    /// The modelled step.
    pub fn step_s(&self) -> f64 {
        match self {
            OnDemandPlan::Gangs(p) => p.step_s,
            OnDemandPlan::Rounds { step_s, .. } => *step_s,
        }
    }
}

/// The shortest of the gangs' plan and the CP placements (see the module docs).
pub fn plan_on_demand<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    costs: &C,
    options: SplitOptions,
) -> Result<OnDemandPlan, SplitError> {
    weigh_placements(plan(lengths, costs, options)?, lengths, costs, options)
}

/// [`plan_on_demand`] from the gangs' plan already made for `lengths` ([`super::plan`] with the
/// same costs and options): `gangs`, or the CP placement that beats it.
pub fn weigh_placements<C: SplitCosts + ?Sized>(
    gangs: SplitPlan,
    lengths: &[u64],
    costs: &C,
    options: SplitOptions,
) -> Result<OnDemandPlan, SplitError> {
    if !options.split || options.min_tokens > 0 || !costs.prices_ring() {
        return Ok(OnDemandPlan::Gangs(gangs));
    }
    let d = costs.devices();
    let cap = match options.max_gang {
        0 => d,
        m => m.min(d),
    };
    // The collective baselines' own candidates (`odc-bench`'s): static CP of the sizes that
    // divide the trainers, and dynamic CP with groups up to the cap.
    let mut candidates: Vec<ContextParallel> = static_cp_sizes(d, cap)
        .map(ContextParallel::Static)
        .collect();
    if cap >= 2 {
        candidates.push(ContextParallel::Dynamic);
    }
    let bar = gangs.step_s * (1.0 - CP_MARGIN);
    let mut best = OnDemandPlan::Gangs(gangs);
    for cp in candidates {
        // A placement the budget does not allow is no candidate.
        let Ok(plan) = plan_cp(lengths, costs, cp, options.token_budget, cap) else {
            continue;
        };
        let step_s = unlocked_step_s(&plan);
        if step_s < bar && step_s < best.step_s() {
            best = OnDemandPlan::Rounds { cp, plan, step_s };
        }
    }
    Ok(best)
}
