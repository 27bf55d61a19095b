//! Sequence splitting (context parallelism) for the long tail of a step: which samples run split
//! over a gang of trainers, how a sample is cut for its gang, and what that costs.
//!
//! - [`zigzag`]: one causal sample cut into `2k` chunks for a gang of `k`, balanced triangles.
//! - [`SplitCosts`] and [`piece_cost`]: the interface that prices a split (implemented by the
//!   runtime and by `odc-bench sim`), and the ring-attention cost of one sample over a gang.
//! - [`plan`]: the planner — which samples to split, over how many members and on which
//!   trainers, the rest packed whole; never a split that lengthens the modelled step.
//! - [`plan_cp`] and [`ContextParallel`]: context parallelism as collective training runs it
//!   (static and dynamic CP), the baselines splitting is measured against.
//! - [`plan_on_demand`]: on-demand's plan, the best of the gangs and the CP placements run
//!   without lockstep.
//! - [`SplitPolicy`]: the user's switch; [`CostModelCosts`]: the runtime's prices.
//! - [`runtime_options`], [`gang_pieces`], [`on_demand_lists`]: a split plan as the runtime runs
//!   it (its options, each gang's pieces, each trainer's list on demand).
//!
//! Pure: no actor, no clock, no I/O; each file's invariants are tested beside it.

mod best;
mod cost;
mod cp;
mod lists;
mod plan;
mod policy;
mod zigzag;

#[cfg(test)]
mod cp_tests;
#[cfg(test)]
mod tests;

pub use best::{plan_on_demand, weigh_placements, OnDemandPlan, CP_MARGIN};
pub use cost::{micro_batch_s, piece_cost, piece_cost_on, transfer_s, Link, PieceCost, SplitCosts};
pub use cp::{plan_cp, static_cp_sizes, unlocked_step_s, ContextParallel, CpCell, CpGang, CpPlan};
pub use lists::{gang_pieces, on_demand_lists, runtime_options, MemberPiece};
pub use plan::{
    gang_sizes, plan, DeviceAssignment, Gang, SplitOptions, SplitPlan, DEFAULT_TOKEN_BUDGET,
};
pub use policy::{CostModelCosts, RingPrice, SplitPolicy};
pub use zigzag::{causal_pairs, zigzag};

/// Why a sample cannot be cut, or a step not planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SplitError {
    #[error("a gang needs at least one member")]
    NoMembers,
    #[error(
        "a sample of {tokens} tokens cannot be cut into {chunks} chunks for {members} members \
         (each member needs two tokens at least)"
    )]
    TooShort {
        tokens: u64,
        members: u32,
        chunks: u64,
    },
    #[error("a split plan needs at least one trainer")]
    NoDevices,
    #[error("a split plan needs at least one trainer per node")]
    NoDevicesPerNode,
    #[error(
        "a context-parallel group of {size} trainers does not divide the {devices} trainers \
         (static CP needs groups of equal size)"
    )]
    CpGroup { size: u32, devices: u32 },
    #[error("the micro-batch token budget must be positive")]
    NoBudget,
    #[error(
        "sample {sample} has {tokens} tokens, over the micro-batch budget of {budget}, and no \
         gang the step allows cuts it into pieces within the budget (more trainers, a larger \
         --max-gang or a larger budget would)"
    )]
    PiecesOverBudget {
        sample: usize,
        tokens: u64,
        budget: u64,
    },
    #[error("{what}{} is {value}: a cost must be a finite, non-negative number", at.map(|i| format!(" of sample {i}")).unwrap_or_default())]
    BadCost {
        what: &'static str,
        at: Option<usize>,
        value: f64,
    },
}
