//! Work queue of one minibatch attempt: which micro-batch an idle trainer takes next.
//!
//! Every trainer has its own list, from the plan, costliest first; it always takes the front of
//! its own list first.
//! - [`DispatchMode::Static`] (ODC's LB-Mini, [`plan_static`](crate::balancer::plan_static)):
//!   that is all; a trainer never takes another trainer's work.
//! - [`DispatchMode::Dynamic`] ([`plan_dynamic`](crate::balancer::plan_dynamic): the same
//!   partition, each list in micro-batches of decreasing size): a trainer whose own list is empty
//!   may **steal** from the list of the trainer expected to finish last a micro-batch it would
//!   finish earlier than its owner would — the one that leaves the two finishing closest
//!   together ([`WorkQueue::steal`], earliest finish time on the speeds the caller gives).
//!
//! Guarantees (tested):
//! - **Q1 exactly once**: every micro-batch of the plan is handed out once ([`WorkQueue::next_own`]
//!   or [`WorkQueue::steal`]), unless the caller puts it back ([`WorkQueue::put_back`]), after
//!   which it is handed out once more.
//! - **Q2 no needless moves**: a steal happens only if the thief, idle now, finishes the
//!   micro-batch strictly before its owner would (after the owner's current micro-batch and the
//!   rest of its list). With equal speeds and costs as modelled, trainers of an exact plan empty
//!   their lists together, so nothing is stolen and every trainer runs exactly its planned work.
//! - **Q3 progress**: a trainer whose list is not empty always gets work; a list owned by a
//!   trainer that is not live is stolen from by any live idle trainer.

use std::collections::VecDeque;

use crate::balancer::Plan;

/// How gathers and gradient pushes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Communication {
    /// Point to point with the shard servers; no trainer waits for another (odc).
    #[default]
    OnDemand,
    /// FSDP-style ring all-gather / reduce-scatter across all trainers, each a barrier; plans are
    /// LB-Micro ([`plan_equal_count`](crate::balancer::plan_equal_count): equal
    /// micro-batch counts, dealt in rounds of similar cost).
    Collective,
}

/// How micro-batches reach trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum DispatchMode {
    /// LB-Mini static plan (Karmarkar–Karp per trainer, counts may differ); no stealing.
    Static,
    /// LB-Mini's partition in micro-batches of decreasing size; idle trainers steal the small
    /// ones at the end from the trainer expected to finish last.
    #[default]
    Dynamic,
}

/// What dispatch knows of a trainer at the moment of a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outlook {
    /// It can take work.
    pub live: bool,
    /// Estimated speed, cost units per second (a value that is not finite and positive disables
    /// stealing by or from this trainer).
    pub speed: f64,
    /// Estimated seconds until its current micro-batch ends: 0 when idle or overdue.
    pub busy_for: f64,
}

impl Outlook {
    /// An idle live trainer of speed `speed`.
    pub fn idle(speed: f64) -> Self {
        Outlook {
            live: true,
            speed,
            busy_for: 0.0,
        }
    }

    /// A live trainer of estimated `speed` that has run its current micro-batch of `cost` for
    /// `ran` seconds: it needs `cost / speed − ran` more (0 when overdue). An overdue trainer is
    /// slower than estimated: not yet done with `cost` after `ran` seconds, it is at most
    /// `cost / ran` fast, which then counts as its speed (so its list is expected to take longer
    /// and is stolen from more readily).
    ///
    /// ```
    /// use odc_policy::dispatch::Outlook;
    /// let on_time = Outlook::busy(2.0, 4.0, 0.5);
    /// assert_eq!((on_time.speed, on_time.busy_for), (2.0, 1.5));
    /// let late = Outlook::busy(2.0, 4.0, 8.0);
    /// assert_eq!((late.speed, late.busy_for), (0.5, 0.0));
    /// ```
    pub fn busy(speed: f64, cost: f64, ran: f64) -> Self {
        let speed = if ran > 0.0 && cost > 0.0 {
            speed.min(cost / ran)
        } else {
            speed
        };
        Outlook {
            live: true,
            speed,
            busy_for: (cost / speed - ran).max(0.0),
        }
    }
}

/// A steal decided by [`WorkQueue::steal`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Steal {
    pub micro_batch: usize,
    /// The trainer whose list it came from.
    pub from: usize,
    /// Estimated seconds from now until the thief finishes it.
    pub thief_finish: f64,
    /// Estimated seconds from now until its owner would have finished it (infinite for an owner
    /// that is not live).
    pub victim_finish: f64,
}

fn valid_speed(speed: f64) -> bool {
    speed.is_finite() && speed > 0.0
}

/// The queue of one minibatch attempt: per trainer slot, its own list, costliest first.
#[derive(Debug, Clone)]
pub struct WorkQueue {
    lists: Vec<VecDeque<usize>>,
    costs: Vec<f64>,
    /// Micro-batches only their owner runs (a gang's pieces): never stolen.
    pinned: Vec<bool>,
}

impl WorkQueue {
    /// The queue of `plan` for `slots` trainer slots, the plan's list `q` owned by slot
    /// `owners[q]` (plans are made for the live slots only). Lists without an owner slot, or with
    /// an owner out of range, are given to slot 0 so that no work is lost.
    pub fn new(plan: &Plan, owners: &[usize], slots: usize) -> Self {
        let mut lists = vec![VecDeque::new(); slots.max(1)];
        for (q, list) in plan.per_trainer.iter().enumerate() {
            let slot = owners.get(q).copied().filter(|&s| s < slots).unwrap_or(0);
            lists[slot].extend(list.iter().copied());
        }
        WorkQueue {
            lists,
            costs: plan.micro_batches.iter().map(|mb| mb.cost).collect(),
            pinned: vec![false; plan.micro_batches.len()],
        }
    }

    /// Pins `micro_batch` to the trainer whose list holds it: [`WorkQueue::steal`] never takes
    /// it (a gang's piece must run on its member).
    pub fn pin(&mut self, micro_batch: usize) {
        if let Some(p) = self.pinned.get_mut(micro_batch) {
            *p = true;
        }
    }

    fn stealable(&self, micro_batch: usize) -> bool {
        !self.pinned.get(micro_batch).copied().unwrap_or(false)
    }

    /// The front (costliest) micro-batch of `trainer`'s own list.
    pub fn next_own(&mut self, trainer: usize) -> Option<usize> {
        self.lists.get_mut(trainer)?.pop_front()
    }

    /// `trainer`'s own list, front first.
    pub fn own(&self, trainer: usize) -> impl Iterator<Item = usize> + '_ {
        self.lists.get(trainer).into_iter().flatten().copied()
    }

    /// Estimated cost of `micro_batch` (0 if unknown).
    pub fn cost(&self, micro_batch: usize) -> f64 {
        self.costs.get(micro_batch).copied().unwrap_or(0.0)
    }

    /// Work stealing for idle `thief` (its own list should be empty), given the [`Outlook`] of
    /// every trainer slot (`trainers[thief]` is the thief's own).
    ///
    /// The victim is the trainer expected to finish last: the largest
    /// `busy_for + cost of its list / speed` (a list whose owner is not live never finishes;
    /// ties go to the lowest slot). Of its list, only micro-batches the thief, free now, would
    /// finish strictly earlier (`cost / thief speed`) than their owner would (after its current
    /// micro-batch and the ones ahead in its list) qualify; the one taken leaves the thief and
    /// the victim finishing closest together — the smallest `max(thief finish, victim finish
    /// without it)`, ties to the smaller micro-batch — so a straggler's queued work moves in one
    /// balanced piece instead of crumb by crumb. A dead owner's list is taken costliest first.
    /// `None` when nothing qualifies; the queue is then unchanged.
    ///
    /// ```
    /// use odc_policy::balancer::{Plan, PlannedMicroBatch};
    /// use odc_policy::dispatch::{Outlook, WorkQueue};
    /// let mb = |cost| PlannedMicroBatch { samples: vec![], tokens: 1, cost };
    /// let plan = Plan {
    ///     micro_batches: vec![mb(4.0), mb(2.0), mb(1.0)],
    ///     per_trainer: vec![vec![], vec![0, 1, 2]],
    /// };
    /// let mut q = WorkQueue::new(&plan, &[0, 1], 2);
    /// // Trainer 1 is busy for 3 s, then has 4 + 2 + 1 units: it would end at 10. Trainer 0 takes
    /// // the 4 (both then end by 6), not the 1 (ending at 1 and 9).
    /// let busy = Outlook { live: true, speed: 1.0, busy_for: 3.0 };
    /// let steal = q.steal(0, &[Outlook::idle(1.0), busy]).unwrap();
    /// assert_eq!((steal.micro_batch, steal.from), (0, 1));
    /// assert_eq!((steal.thief_finish, steal.victim_finish), (4.0, 10.0));
    /// // A trainer ten times slower would finish it later than its owner: no steal.
    /// assert_eq!(q.steal(0, &[Outlook::idle(0.05), busy]), None);
    /// ```
    pub fn steal(&mut self, thief: usize, trainers: &[Outlook]) -> Option<Steal> {
        let me = trainers.get(thief)?;
        if !me.live || !valid_speed(me.speed) {
            return None;
        }
        let finish = |t: usize| -> Option<f64> {
            let list = &self.lists[t];
            let outlook = trainers.get(t)?;
            if !outlook.live {
                return Some(f64::INFINITY);
            }
            if !valid_speed(outlook.speed) {
                return None;
            }
            let work: f64 = list.iter().map(|&mb| self.cost(mb).max(0.0)).sum();
            Some(outlook.busy_for.max(0.0) + work / outlook.speed)
        };
        let (victim, victim_finish) = (0..self.lists.len())
            .filter(|&t| t != thief && self.lists[t].iter().any(|&mb| self.stealable(mb)))
            .filter_map(|t| Some((t, finish(t)?)))
            .filter(|(_, f)| !f.is_nan())
            .fold(None, |best: Option<(usize, f64)>, (t, f)| match best {
                Some((_, bf)) if bf >= f => best,
                _ => Some((t, f)),
            })?;
        let victim_outlook = trainers.get(victim)?;
        let candidate = if !victim_outlook.live {
            // Nobody will run a dead owner's list: take its costliest first (longest first).
            let position = self.lists[victim]
                .iter()
                .position(|&mb| self.stealable(mb))?;
            Some((
                position,
                self.cost(self.lists[victim][position]).max(0.0) / me.speed,
            ))
        } else {
            // Among the micro-batches the thief finishes strictly before their owner would, the
            // one that leaves the two finishing closest together (the lower of their two new
            // finish times is as high as it can be); ties go to the smaller one.
            let mut owner_done = victim_outlook.busy_for.max(0.0);
            let mut best: Option<(usize, f64, f64)> = None;
            for (position, &mb) in self.lists[victim].iter().enumerate() {
                let cost = self.cost(mb).max(0.0);
                owner_done += cost / victim_outlook.speed;
                let thief_done = cost / me.speed;
                if thief_done >= owner_done || !self.stealable(mb) {
                    continue;
                }
                let makespan = thief_done.max(victim_finish - cost / victim_outlook.speed);
                if best.is_none_or(|(_, _, m)| makespan <= m) {
                    best = Some((position, thief_done, makespan));
                }
            }
            best.map(|(position, thief_done, _)| (position, thief_done))
        };
        let (position, thief_finish) = candidate?;
        let micro_batch = self.lists[victim].remove(position)?;
        Some(Steal {
            micro_batch,
            from: victim,
            thief_finish,
            victim_finish,
        })
    }

    /// Put `micro_batch` back at the front of `trainer`'s list (it is handed out again next).
    pub fn put_back(&mut self, trainer: usize, micro_batch: usize) {
        let last = self.lists.len() - 1;
        self.lists[trainer.min(last)].push_front(micro_batch);
    }

    /// Micro-batches not yet handed out.
    pub fn remaining(&self) -> usize {
        self.lists.iter().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::{plan_dynamic, plan_static, CostModel, PlannedMicroBatch};
    use proptest::prelude::*;

    fn plan(costs: &[f64], per_trainer: Vec<Vec<usize>>) -> Plan {
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
    fn pinned_micro_batches_are_never_stolen() {
        // Trainer 1 is slow and holds 0 (pinned: a gang's piece) and 1; trainer 2 is dead and
        // holds 2 (pinned) and 3. Thieves take only the unpinned ones, then nothing.
        let p = plan(&[8.0, 4.0, 6.0, 2.0], vec![vec![], vec![0, 1], vec![2, 3]]);
        let mut q = WorkQueue::new(&p, &[0, 1, 2], 3);
        q.pin(0);
        q.pin(2);
        let slow = Outlook {
            live: true,
            speed: 0.01,
            busy_for: 0.0,
        };
        let dead = Outlook {
            live: false,
            ..Outlook::idle(1.0)
        };
        let outlooks = [Outlook::idle(1.0), slow, dead];
        let mut stolen = Vec::new();
        while let Some(s) = q.steal(0, &outlooks) {
            stolen.push(s.micro_batch);
        }
        stolen.sort_unstable();
        assert_eq!(stolen, vec![1, 3]);
        assert_eq!(q.own(1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(q.own(2).collect::<Vec<_>>(), vec![2]);
        // Unpinned, the same queue gives them up.
        let mut q = WorkQueue::new(&p, &[0, 1, 2], 3);
        let mut all = Vec::new();
        while let Some(s) = q.steal(0, &outlooks) {
            all.push(s.micro_batch);
        }
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }

    #[test]
    fn own_list_costliest_first_then_nothing() {
        let p = plan(&[5.0, 3.0, 1.0], vec![vec![0], vec![1, 2]]);
        let mut q = WorkQueue::new(&p, &[0, 1], 2);
        assert_eq!(q.next_own(0), Some(0));
        assert_eq!(q.next_own(0), None);
        assert_eq!(q.own(0).count(), 0);
        assert_eq!(q.next_own(1), Some(1));
        q.put_back(1, 1);
        assert_eq!(q.own(1).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(q.next_own(1), Some(1));
        assert_eq!(q.next_own(1), Some(2));
        assert_eq!(q.remaining(), 0);
        assert_eq!(q.next_own(7), None);
    }

    #[test]
    fn lists_follow_their_owner_slots() {
        // Plan made for live slots 1 and 3 of four.
        let p = plan(&[5.0, 3.0], vec![vec![0], vec![1]]);
        let mut q = WorkQueue::new(&p, &[1, 3], 4);
        assert_eq!(q.own(0).chain(q.own(2)).count(), 0);
        assert_eq!(q.next_own(3), Some(1));
        assert_eq!(q.next_own(1), Some(0));
        // A list without an owner is not lost.
        let mut q = WorkQueue::new(&p, &[1], 2);
        assert_eq!(q.remaining(), 2);
        assert_eq!(q.next_own(0), Some(1));
    }

    #[test]
    fn steal_takes_the_piece_that_balances_thief_and_victim() {
        let p = plan(
            &[8.0, 6.0, 4.0, 2.0, 1.0],
            vec![vec![], vec![0, 3], vec![1, 2, 4]],
        );
        let mut q = WorkQueue::new(&p, &[0, 1, 2], 3);
        let idle = Outlook::idle(1.0);
        // Trainer 1 will finish at 10, trainer 2 at 11 (6, 4, 1). Its 6 the thief would not
        // finish earlier than its owner (both at 6); the 4 leaves them at 4 and 7, the 1 at 1
        // and 10: the 4 is taken.
        let s = q.steal(0, &[idle, idle, idle]).unwrap();
        assert_eq!((s.micro_batch, s.from), (2, 2));
        assert_eq!((s.thief_finish, s.victim_finish), (4.0, 11.0));
        // Now trainer 1 (8, 2) finishes last, at 10: the 2 is the only one the thief finishes
        // earlier (at 2, the owner at 10).
        let s = q.steal(0, &[idle, idle, idle]).unwrap();
        assert_eq!((s.micro_batch, s.from), (3, 1));
    }

    #[test]
    fn no_steal_when_the_owner_finishes_it_first() {
        let p = plan(&[3.0], vec![vec![], vec![0]]);
        let mut q = WorkQueue::new(&p, &[0, 1], 2);
        // The owner is idle and as fast: it starts now and finishes at the same time.
        assert_eq!(q.steal(0, &[Outlook::idle(1.0), Outlook::idle(1.0)]), None);
        // A faster thief finishes earlier.
        let s = q
            .steal(0, &[Outlook::idle(2.0), Outlook::idle(1.0)])
            .unwrap();
        assert_eq!(s.micro_batch, 0);
        assert_eq!(q.remaining(), 0);
        assert_eq!(q.steal(0, &[Outlook::idle(2.0), Outlook::idle(1.0)]), None);
    }

    #[test]
    fn dead_owner_is_always_stolen_from_and_bad_speeds_disable_stealing() {
        let p = plan(&[3.0], vec![vec![], vec![0]]);
        let dead = Outlook {
            live: false,
            speed: 1.0,
            busy_for: 0.0,
        };
        let mut q = WorkQueue::new(&p, &[0, 1], 2);
        assert_eq!(q.steal(0, &[Outlook::idle(f64::NAN), dead]), None);
        assert_eq!(q.steal(0, &[Outlook::idle(0.0), dead]), None);
        assert_eq!(q.steal(5, &[Outlook::idle(1.0), dead]), None);
        let s = q.steal(0, &[Outlook::idle(1e-9), dead]).unwrap();
        assert_eq!(s.victim_finish, f64::INFINITY);
        // An owner of unknown speed is not stolen from.
        let mut q = WorkQueue::new(&p, &[0, 1], 2);
        let odd = Outlook {
            live: true,
            speed: f64::INFINITY,
            busy_for: 100.0,
        };
        assert_eq!(q.steal(0, &[Outlook::idle(1.0), odd]), None);
    }

    /// Dispatch in simulated time: every idle trainer (in slot order) takes its own next
    /// micro-batch or, when `known` speeds are given (the measured ones, or all equal), steals
    /// with estimates on them; trainers really run at `speeds`. Returns each trainer's total
    /// cost, the steals and the makespan.
    fn simulate(p: &Plan, speeds: &[f64], known: Option<&[f64]>) -> (Vec<f64>, usize, f64) {
        let n = speeds.len();
        let owners: Vec<usize> = (0..n).collect();
        let mut q = WorkQueue::new(p, &owners, n);
        // (micro-batch, started, ends) per trainer.
        let mut running: Vec<Option<(usize, f64, f64)>> = vec![None; n];
        let mut done = vec![0.0; n];
        let (mut now, mut steals) = (0.0_f64, 0);
        loop {
            for t in 0..n {
                if running[t].is_some() {
                    continue;
                }
                let mb = match (q.next_own(t), known) {
                    (Some(mb), _) => Some(mb),
                    (None, None) => None,
                    (None, Some(known)) => {
                        let outlooks: Vec<Outlook> = (0..n)
                            .map(|o| match running[o] {
                                Some((mb, start, _)) => {
                                    Outlook::busy(known[o], q.cost(mb), now - start)
                                }
                                None => Outlook::idle(known[o]),
                            })
                            .collect();
                        q.steal(t, &outlooks).map(|s| {
                            steals += 1;
                            s.micro_batch
                        })
                    }
                };
                if let Some(mb) = mb {
                    running[t] = Some((mb, now, now + q.cost(mb) / speeds[t]));
                }
            }
            let Some(next) = running.iter().flatten().map(|r| r.2).reduce(f64::min) else {
                break;
            };
            now = next;
            for t in 0..n {
                if let Some((mb, _, end)) = running[t] {
                    if end <= now {
                        done[t] += q.cost(mb);
                        running[t] = None;
                    }
                }
            }
        }
        assert_eq!(q.remaining(), 0, "every micro-batch ran");
        (done, steals, now)
    }

    #[test]
    fn q2_equal_speeds_balanced_data_nothing_is_stolen() {
        let m = CostModel::odc_7b();
        for (samples, trainers) in [(32, 4), (48, 8), (12, 3), (7, 7)] {
            let tokens = vec![6_000u64; samples];
            let dynamic = plan_dynamic(&tokens, &m, trainers, 65_536).unwrap();
            let fixed = plan_static(&tokens, &m, trainers, 65_536).unwrap();
            let speeds = vec![1.0; trainers];
            let (done, steals, _) = simulate(&dynamic, &speeds, Some(&speeds));
            assert_eq!(steals, 0, "{samples} samples on {trainers}");
            for (got, want) in done.iter().zip(fixed.trainer_costs()) {
                assert!((got - want).abs() <= 1e-9 * want, "the same work as static");
            }
        }
    }

    #[test]
    fn quarter_speed_trainer_ends_with_clearly_less_work() {
        let m = CostModel::odc_7b();
        let tokens: Vec<u64> = (0..64).map(|i| 2_000 + (i * 7_919) % 30_000).collect();
        let p = plan_dynamic(&tokens, &m, 4, 65_536).unwrap();
        let speeds = [0.25, 1.0, 1.0, 1.0];
        let planned = p.trainer_costs();
        let (_, _, static_makespan) =
            simulate(&plan_static(&tokens, &m, 4, 65_536).unwrap(), &speeds, None);
        for known in [[1.0; 4], speeds] {
            let (done, steals, makespan) = simulate(&p, &speeds, Some(&known));
            let others = (done[1] + done[2] + done[3]) / 3.0;
            assert!(steals > 0);
            assert!(
                done[0] < 0.6 * planned[0] && done[0] < 0.6 * others,
                "known speeds {known:?}: slow trainer ran {} of planned {}, others {others}",
                done[0],
                planned[0]
            );
            assert!(
                makespan < 0.75 * static_makespan,
                "{makespan} vs {static_makespan}"
            );
        }
    }

    proptest! {
        #[test]
        fn q1_every_micro_batch_handed_out_exactly_once(
            tokens in prop::collection::vec(1u64..32_000, 1..60),
            trainers in 1usize..6,
            ops in prop::collection::vec(
                (0usize..6, any::<bool>(), prop::collection::vec((0.05f64..4.0, 0.0f64..20.0, any::<bool>()), 6)),
                0..80),
        ) {
            let p = plan_dynamic(&tokens, &CostModel::odc_7b(), trainers, 65_536).unwrap();
            let owners: Vec<usize> = (0..trainers).collect();
            let mut q = WorkQueue::new(&p, &owners, trainers);
            let mut seen = vec![0u32; p.micro_batches.len()];
            for (t, own, view) in ops {
                let t = t % trainers;
                let got = if own {
                    q.next_own(t)
                } else {
                    let outlooks: Vec<Outlook> = view
                        .iter()
                        .take(trainers)
                        .map(|&(speed, busy_for, live)| Outlook { live, speed, busy_for })
                        .collect();
                    q.steal(t, &outlooks).map(|s| s.micro_batch)
                };
                if let Some(mb) = got {
                    seen[mb] += 1;
                }
            }
            for t in 0..trainers {
                while let Some(mb) = q.next_own(t) {
                    seen[mb] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1), "{:?}", seen);
            prop_assert_eq!(q.remaining(), 0);
        }

        #[test]
        fn dynamic_lists_shrink_towards_the_end(
            tokens in prop::collection::vec(1u64..32_000, 1..80),
            trainers in 1usize..6,
        ) {
            let p = plan_dynamic(&tokens, &CostModel::odc_7b(), trainers, 65_536).unwrap();
            for list in &p.per_trainer {
                let costs: Vec<f64> = list.iter().map(|&i| p.micro_batches[i].cost).collect();
                prop_assert!(costs.windows(2).all(|w| w[0] >= w[1]), "{:?}", costs);
                if let Some(&last) = list.last() {
                    prop_assert_eq!(p.micro_batches[last].samples.len(), 1);
                }
            }
        }
    }
}
