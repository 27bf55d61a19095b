//! The balancer: a pure policy core (see [`crate`]) that turns a minibatch's samples into
//! micro-batches and assigns them to trainers.
//!
//! - [`cost`]: the per-sample cost model `a·ŝ² + b·ŝ` ([`CostModel`]);
//! - [`packing`]: token-budget packing into micro-batches ([`pack`], first-fit decreasing,
//!   [`pack_even`], as few of even cost, and [`pack_guided`], decreasing sizes, with a fill floor
//!   in [`pack_guided_filled`]);
//! - [`partition`](mod@partition): `k`-way partitioning by cost ([`greedy_partition`],
//!   [`karmarkar_karp`], and the planner's [`partition`](fn@partition));
//! - [`plan`]: minibatch plans for the three dispatch modes ([`plan_static`] = ODC's LB-Mini,
//!   [`plan_dynamic`] = LB-Mini in decreasing sizes, [`plan_equal_count`] = LB-Micro for
//!   collectives), and [`weighted`] for trainers of measured speeds.
//!
//! Guarantees: every function is deterministic and total — bad input gives a [`BalanceError`],
//! never a panic; every successful plan places every sample exactly once (docs/design.md I2 at planning
//! time) in micro-batches within the token budget, sorted by estimated cost descending.
//!
//! ```
//! use odc_policy::balancer::{plan_static, CostModel};
//! let tokens = [40_000, 9_000, 12_000, 30_000, 5_000, 22_000];
//! let plan = plan_static(&tokens, &CostModel::odc_7b(), 2, 65_536).unwrap();
//! assert_eq!(plan.num_samples(), tokens.len());
//! for (trainer, mbs) in plan.per_trainer.iter().enumerate() {
//!     for &i in mbs {
//!         let mb = &plan.micro_batches[i];
//!         assert!(mb.tokens <= 65_536);
//!         println!("trainer {trainer}: samples {:?}, cost {:.3}", mb.samples, mb.cost);
//!     }
//! }
//! ```

pub mod cost;
mod error;
pub mod packing;
pub mod partition;
pub mod plan;
pub mod weighted;

pub use cost::CostModel;
pub use error::BalanceError;
pub use packing::{pack, pack_even, pack_guided, pack_guided_filled};
pub use partition::{
    greedy_partition, greedy_partition_equal_count, karmarkar_karp, loads, max_load, partition,
};
pub use plan::{
    plan_dynamic, plan_dynamic_filled, plan_equal_count, plan_static, Plan, PlannedMicroBatch,
    MAX_TRAINERS,
};
pub use weighted::{plan_dynamic_weighted, plan_dynamic_weighted_filled, plan_static_weighted};
