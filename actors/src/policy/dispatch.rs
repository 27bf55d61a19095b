//! Work queue: which micro-batch an idle trainer takes next.
//!
//! - [`DispatchMode::Static`]: ODC's LB-Mini plan fixes each trainer's list up front; a trainer takes
//!   the next of its own list (costliest first) and never another trainer's.
//! - [`DispatchMode::Dynamic`]: one shared list sorted by cost, descending; an idle trainer takes the
//!   costliest remaining micro-batch (greedy longest-first at runtime, which adapts to stragglers).
//!
//! Every micro-batch is handed out at most once ([`WorkQueue::next_for`]); one a failed trainer held
//! is handed out again only after [`WorkQueue::requeue`].

use std::collections::VecDeque;

use crate::policy::balancer::Plan;

/// How gathers and gradient pushes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Communication {
    /// Point to point with the shard servers; no trainer waits for another (odc).
    #[default]
    OnDemand,
    /// FSDP-style ring all-gather / reduce-scatter across all trainers, each a barrier; plans are
    /// LB-Micro ([`plan_equal_count`](crate::policy::balancer::plan_equal_count): equal micro-batch counts,
    /// dealt in rounds of similar cost).
    Collective,
}

/// How micro-batches reach trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DispatchMode {
    /// LB-Mini static plan (Karmarkar–Karp per trainer, counts may differ).
    Static,
    /// Idle trainer takes the costliest remaining micro-batch.
    #[default]
    Dynamic,
}

/// The queue of one minibatch attempt.
#[derive(Debug, Clone)]
pub struct WorkQueue {
    shared: VecDeque<usize>,
    per_trainer: Vec<VecDeque<usize>>,
}

impl WorkQueue {
    /// Build from a plan: static when the plan has a per-trainer assignment, dynamic otherwise.
    /// Trainer slots beyond the plan's assignment get no work of their own.
    pub fn from_plan(plan: &Plan, trainers: usize) -> Self {
        match &plan.per_trainer {
            Some(lists) => {
                let mut per_trainer: Vec<VecDeque<usize>> =
                    lists.iter().map(|l| l.iter().copied().collect()).collect();
                per_trainer.resize(trainers.max(per_trainer.len()), VecDeque::new());
                WorkQueue {
                    shared: VecDeque::new(),
                    per_trainer,
                }
            }
            None => WorkQueue {
                shared: (0..plan.micro_batches.len()).collect(),
                per_trainer: vec![VecDeque::new(); trainers],
            },
        }
    }

    /// The next micro-batch for `trainer`, if any: its own list first, then the shared one.
    pub fn next_for(&mut self, trainer: usize) -> Option<usize> {
        if let Some(own) = self.per_trainer.get_mut(trainer) {
            if let Some(mb) = own.pop_front() {
                return Some(mb);
            }
        }
        self.shared.pop_front()
    }

    /// The shared list's micro-batches in order (costliest first).
    pub fn shared(&self) -> impl Iterator<Item = usize> + '_ {
        self.shared.iter().copied()
    }

    /// Take the micro-batch at `position` of the shared list.
    pub fn take_shared(&mut self, position: usize) -> Option<usize> {
        self.shared.remove(position)
    }

    /// True when `trainer` has no list of its own left (it takes from the shared list).
    pub fn own_is_empty(&self, trainer: usize) -> bool {
        self.per_trainer.get(trainer).is_none_or(VecDeque::is_empty)
    }

    /// Put a micro-batch back at the front of the shared list (taken next by any idle trainer).
    pub fn requeue(&mut self, micro_batch: usize) {
        self.shared.push_front(micro_batch);
    }

    /// Micro-batches not yet handed out.
    pub fn remaining(&self) -> usize {
        self.shared.len() + self.per_trainer.iter().map(VecDeque::len).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::balancer::PlannedMicroBatch;

    fn plan(costs: &[f64], per_trainer: Option<Vec<Vec<usize>>>) -> Plan {
        Plan {
            micro_batches: costs
                .iter()
                .map(|&c| PlannedMicroBatch {
                    samples: vec![],
                    tokens: 1,
                    cost: c,
                })
                .collect(),
            per_trainer,
        }
    }

    #[test]
    fn dynamic_hands_out_costliest_first_exactly_once() {
        let mut q = WorkQueue::from_plan(&plan(&[5.0, 3.0, 1.0], None), 2);
        assert_eq!(q.next_for(1), Some(0));
        assert_eq!(q.next_for(0), Some(1));
        assert_eq!(q.next_for(1), Some(2));
        assert_eq!(q.next_for(0), None);
        assert_eq!(q.remaining(), 0);
    }

    #[test]
    fn static_trainer_only_takes_its_own_list() {
        let p = plan(&[5.0, 3.0, 1.0], Some(vec![vec![0], vec![1, 2]]));
        let mut q = WorkQueue::from_plan(&p, 2);
        assert_eq!(q.next_for(0), Some(0));
        assert_eq!(q.next_for(0), None);
        assert_eq!(q.next_for(1), Some(1));
        q.requeue(1);
        assert!(q.own_is_empty(0));
        assert_eq!(q.shared().collect::<Vec<_>>(), vec![1]);
        assert_eq!(q.take_shared(0), Some(1));
        q.requeue(1);
        assert_eq!(q.next_for(0), Some(1));
        assert_eq!(q.next_for(1), Some(2));
        assert_eq!(q.remaining(), 0);
    }
}
