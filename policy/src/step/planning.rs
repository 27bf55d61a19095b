//! Planning an attempt for the live trainers and handing out micro-batches (static lists, or
//! dynamic dispatch with stealing).

use std::time::Duration;

use crate::assignment::Assignment;
use crate::balancer::{
    plan_dynamic_filled, plan_dynamic_weighted_filled, plan_equal_count, plan_static,
    plan_static_weighted,
};
use crate::batch::{MicroBatch, Piece, SampleMeta};
use crate::clock::Timestamp;
use crate::dispatch::{Communication, DispatchMode, Outlook, WorkQueue};
use crate::ledger::Ledger;
use crate::split::{ContextParallel, MemberPiece};
use crate::stats::TrainerStepStats;

use super::decision::{decision, Command, Decision, Reason};
use super::error::{Failure, StepError};
use super::machine::StepMachine;
use super::run::{Attempt, Busy, Phase, Presence};
use crate::balancer::{Plan, PlannedMicroBatch};
use crate::split::OnDemandPlan;

/// A plan with gangs: the plan, and per micro-batch its pieces (none: whole samples only).
type SplitAttempt = (Plan, Vec<Vec<Piece>>);

impl<E: Failure> StepMachine<E> {
    /// Plan `samples` for the live slots: a fresh attempt.
    pub(super) fn plan(&self, samples: &[SampleMeta]) -> Result<Attempt, StepError> {
        let live: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].presence == Presence::Live)
            .collect();
        if live.is_empty() {
            return Err(StepError::NoTrainers {
                step: self.global_step(),
            });
        }
        let tokens: Vec<u64> = samples.iter().map(|s| s.tokens).collect();
        let c = &self.config;
        let measured = || -> Vec<f64> {
            let all = self.speeds.speeds();
            live.iter()
                .map(|&s| all.get(s).copied().unwrap_or(1.0))
                .collect()
        };
        // The fill floor in tokens (`min_fill` in 0..=1, so at most the budget).
        let fill = (c.min_fill.clamp(0.0, 1.0) * c.token_budget as f64) as u64;
        if c.communication == Communication::Collective && live.len() != self.slots.len() {
            return Err(StepError::Config(format!(
                "collective mode needs all {} trainers, {} are left",
                self.slots.len(),
                live.len()
            )));
        }
        let split = match c.context_parallel {
            ContextParallel::Off => self.plan_split(samples, &tokens, &live)?,
            cp => Some(self.plan_context_parallel(samples, &tokens, cp)?),
        };
        // Splitting only where it shortens the step the whole-sample plan would take, both
        // priced by the job's cost model (the split planner's own unsplit placement is LPT, not
        // this plan's partition), or where no whole-sample plan exists (a sample over the
        // budget whose pieces fit).
        let whole = self.plan_whole(&tokens, &live, &measured, fill);
        let whole_s = |plan: &Plan| match c.communication {
            Communication::OnDemand => plan.trainer_costs().into_iter().fold(0.0, f64::max),
            Communication::Collective => lockstep_s(plan),
        };
        // Context parallelism is the job's choice, not a price's: its plan runs as planned.
        let chosen = c.context_parallel != ContextParallel::Off;
        let (plan, pieces) = match (split, whole) {
            (Some((step_s, _)), Ok(whole)) if !chosen && step_s >= whole_s(&whole) => {
                (whole, Vec::new())
            }
            (Some((_, split)), _) => split,
            (None, whole) => (whole?, Vec::new()),
        };
        let micro_batches: Vec<MicroBatch> = plan
            .micro_batches
            .iter()
            .enumerate()
            .map(|(id, mb)| MicroBatch {
                // The parameter version every read of it must return (I1).
                step: self.version,
                id: id as u32,
                samples: mb
                    .samples
                    .iter()
                    .filter_map(|&i| samples.get(i).copied())
                    .collect(),
                tokens: mb.tokens,
                cost: mb.cost,
                weighting: c.weighting,
                pieces: pieces.get(id).cloned().unwrap_or_default(),
            })
            .collect();
        let mut queue = WorkQueue::new(&plan, &live, self.slots.len());
        for (id, pieces) in pieces.iter().enumerate() {
            if !pieces.is_empty() {
                queue.pin(id);
            }
        }
        Ok(Attempt {
            epoch: self.epoch,
            queue,
            ledger: Ledger::new(micro_batches.len()),
            micro_batches,
            loss_sum: 0.0,
            trainers: vec![TrainerStepStats::default(); self.slots.len()],
            log: Vec::new(),
            early_relay_flushes: 0,
            relays_expected: false,
        })
    }

    /// The plan of whole samples (no splitting) for the `live` slots.
    fn plan_whole(
        &self,
        tokens: &[u64],
        live: &[usize],
        measured: &dyn Fn() -> Vec<f64>,
        fill: u64,
    ) -> Result<Plan, StepError> {
        let c = &self.config;
        Ok(match (c.communication, c.dispatch, c.rebalance) {
            (Communication::Collective, _, _) => {
                plan_equal_count(tokens, &c.cost, live.len(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Static, true) => {
                plan_static_weighted(tokens, &c.cost, &measured(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Dynamic, true) => {
                plan_dynamic_weighted_filled(tokens, &c.cost, &measured(), c.token_budget, fill)?
            }
            (Communication::OnDemand, DispatchMode::Static, false) => {
                plan_static(tokens, &c.cost, live.len(), c.token_budget)?
            }
            (Communication::OnDemand, DispatchMode::Dynamic, false) => {
                plan_dynamic_filled(tokens, &c.cost, live.len(), c.token_budget, fill)?
            }
        })
    }

    /// The plan with sequence splitting ([`crate::split::plan`]) when the job's policy allows it
    /// and the planner splits at least one sample: the gangs' pieces first on each member's list
    /// (in gang order, the same on every member), then its micro-batches of whole samples, with
    /// the planner's modelled step. `None`: nothing is split, the plan is
    /// [`StepMachine::plan_whole`]'s, unchanged.
    fn plan_split(
        &self,
        samples: &[SampleMeta],
        tokens: &[u64],
        slots: &[usize],
    ) -> Result<Option<(f64, SplitAttempt)>, StepError> {
        let c = &self.config;
        let live = slots.len();
        let Some(min_tokens) = c.split.min_tokens() else {
            return Ok(None);
        };
        let live32 = u32::try_from(live).unwrap_or(u32::MAX);
        let (costs, options) = crate::split::runtime_options(
            c.cost,
            live32,
            c.max_gang,
            c.ring_price,
            c.token_budget,
            min_tokens,
        );
        let err = |e| StepError::Config(format!("sequence splitting: {e}"));
        let split = if c.communication == Communication::OnDemand {
            // On demand the CP placements are candidates too (where the job prices the ring),
            // run without lockstep; their trainers are the live slots, in order.
            match crate::split::plan_on_demand(tokens, &costs, options).map_err(err)? {
                OnDemandPlan::Gangs(split) => split,
                OnDemandPlan::Rounds { plan, step_s, .. } => {
                    let (plan, mut pieces) = self.cells(samples, tokens, &plan, false)?;
                    for p in pieces.iter_mut().flatten() {
                        let slot = |d: &u32| slots.get(*d as usize).copied().unwrap_or(0) as u32;
                        p.ranks = p.ranks.iter().map(slot).collect();
                    }
                    return Ok(Some((step_s, (plan, pieces))));
                }
            }
        } else {
            crate::split::plan(tokens, &costs, options).map_err(err)?
        };
        if split.gangs.is_empty() {
            return Ok(None);
        }
        // Each member's piece as the step's: its sample, attempt and gang, the members' slots.
        let piece = |m: &MemberPiece| {
            let gang = &split.gangs[m.gang];
            let slot = |&d: &u32| slots.get(d as usize).copied().unwrap_or(0) as u32;
            Piece {
                sample: samples[gang.sample],
                epoch: self.epoch,
                gang: m.gang as u32,
                member: m.member,
                members: gang.cost.k,
                ranks: gang.devices.iter().map(slot).collect(),
            }
        };
        if c.communication == Communication::OnDemand {
            let (plan, members) =
                crate::split::on_demand_lists(tokens, &c.cost, &split).map_err(err)?;
            let pieces = members
                .iter()
                .map(|m| m.iter().map(piece).collect())
                .collect();
            return Ok(Some((split.step_s, (plan, pieces))));
        }
        // Each gang's micro-batches, one per member: (device, micro-batch, piece).
        let mut members: Vec<Vec<(usize, PlannedMicroBatch, Piece)>> = Vec::new();
        for (g, gang) in split.gangs.iter().enumerate() {
            let of_gang = crate::split::gang_pieces(g, gang).map_err(err)?;
            let of_gang = of_gang
                .into_iter()
                .map(|(d, mb, m)| (d as usize, mb, piece(&m)));
            members.push(of_gang.collect());
        }
        let mut out = Assembly::new(live);
        // Lockstep (every trainer runs the same number of micro-batches, round by round): each
        // gang takes the first round where its members are free; the other trainers of a
        // gang's round run an empty micro-batch (a collective needs every trainer); then the
        // unsplit samples as LB-Micro.
        let mut rounds: Vec<Vec<Option<(usize, usize)>>> = Vec::new();
        for (g, gang) in members.iter().enumerate() {
            let free = |round: &Vec<Option<(usize, usize)>>| {
                gang.iter().all(|(d, _, _)| round[*d].is_none())
            };
            let r = match rounds.iter().position(free) {
                Some(r) => r,
                None => {
                    rounds.push(vec![None; live]);
                    rounds.len() - 1
                }
            };
            for (m, (d, _, _)) in gang.iter().enumerate() {
                rounds[r][*d] = Some((g, m));
            }
        }
        let empty = PlannedMicroBatch {
            samples: Vec::new(),
            tokens: 0,
            cost: c.cost.micro_batch(0.0),
        };
        for round in &rounds {
            for (device, at) in round.iter().enumerate() {
                match at {
                    Some((g, m)) => {
                        let (_, mb, piece) = &members[*g][*m];
                        out.push(device, mb.clone(), vec![piece.clone()]);
                    }
                    None => out.push(device, empty.clone(), Vec::new()),
                }
            }
        }
        let rest: Vec<usize> = (0..tokens.len())
            .filter(|i| !split.gangs.iter().any(|g| g.sample == *i))
            .collect();
        if !rest.is_empty() {
            let sub: Vec<u64> = rest.iter().map(|&i| tokens[i]).collect();
            let whole = plan_equal_count(&sub, &c.cost, live, c.token_budget)?;
            for (device, list) in whole.per_trainer.iter().enumerate() {
                for &i in list {
                    let mb = &whole.micro_batches[i];
                    let samples = mb.samples.iter().map(|&s| rest[s]).collect();
                    out.push(
                        device,
                        PlannedMicroBatch {
                            samples,
                            ..mb.clone()
                        },
                        Vec::new(),
                    );
                }
            }
        }
        let plan = out.plan;
        Ok(Some((lockstep_s(&plan), (plan, out.pieces))))
    }

    /// The lockstep plan of collective training with context parallelism `cp`
    /// ([`crate::split::plan_cp`]): round `r` is every trainer's `r`-th micro-batch, each holding
    /// its whole samples and its pieces (gangs ascending), with the planner's modelled step.
    fn plan_context_parallel(
        &self,
        samples: &[SampleMeta],
        tokens: &[u64],
        cp: ContextParallel,
    ) -> Result<(f64, SplitAttempt), StepError> {
        let c = &self.config;
        let d = self.slots.len();
        let d32 = u32::try_from(d).unwrap_or(u32::MAX);
        let (costs, _) =
            crate::split::runtime_options(c.cost, d32, c.max_gang, c.ring_price, c.token_budget, 0);
        let plan = crate::split::plan_cp(tokens, &costs, cp, c.token_budget, c.max_gang)
            .map_err(|e| StepError::Config(format!("context parallelism ({cp}): {e}")))?;
        Ok((plan.step_s, self.cells(samples, tokens, &plan, true)?))
    }

    /// The micro-batches of a context-parallel placement: each trainer's cells in round order,
    /// each holding its whole samples and its pieces (gangs ascending); with `keep_empty` (a
    /// collective's lockstep) an empty cell is an empty micro-batch, otherwise none.
    fn cells(
        &self,
        samples: &[SampleMeta],
        tokens: &[u64],
        plan: &crate::split::CpPlan,
        keep_empty: bool,
    ) -> Result<SplitAttempt, StepError> {
        let d = plan.rounds.first().map_or(self.slots.len(), Vec::len);
        let mut out = Assembly::new(d);
        for round in &plan.rounds {
            for (device, cell) in round.iter().enumerate() {
                if !keep_empty && cell.samples.is_empty() && cell.pieces.is_empty() {
                    continue;
                }
                let mut pieces = Vec::with_capacity(cell.pieces.len());
                let mut piece_tokens = 0;
                for &(g, member) in &cell.pieces {
                    let gang = &plan.gangs[g];
                    let cut = crate::split::zigzag(gang.tokens, gang.cost.k)
                        .map_err(|e| StepError::Config(format!("context parallelism: {e}")))?;
                    piece_tokens += cut[member as usize]
                        .iter()
                        .map(|r| r.end - r.start)
                        .sum::<u64>();
                    pieces.push(Piece {
                        sample: samples[gang.sample],
                        epoch: self.epoch,
                        gang: g as u32,
                        member,
                        members: gang.cost.k,
                        ranks: gang.devices.clone(),
                    });
                }
                let planned = PlannedMicroBatch {
                    samples: cell.samples.clone(),
                    tokens: cell.samples.iter().map(|&i| tokens[i]).sum::<u64>() + piece_tokens,
                    cost: cell.cost_s,
                };
                out.push(device, planned, pieces);
            }
        }
        Ok((out.plan, out.pieces))
    }

    /// Whether idle trainers steal (dynamic dispatch, on-demand mode).
    pub(super) fn steals(&self) -> bool {
        self.config.dispatch == DispatchMode::Dynamic
            && self.config.communication == Communication::OnDemand
    }

    /// Every slot as dispatch sees it now: measured speeds (`rebalance`) or all equal, and the
    /// estimated rest of its current micro-batch ([`Outlook::busy`]).
    pub(super) fn outlooks(&self, now: Timestamp) -> Vec<Outlook> {
        let measured = self.speeds.speeds();
        let mean = measured.iter().sum::<f64>() / measured.len().max(1) as f64;
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let speed = if self.config.rebalance {
                    measured.get(i).copied().unwrap_or(mean)
                } else {
                    mean
                };
                let outlook = match s.busy {
                    Some(b) => {
                        let ran = now.saturating_duration_since(b.since).as_secs_f64();
                        Outlook::busy(speed, b.cost, ran)
                    }
                    None => Outlook::idle(speed),
                };
                Outlook {
                    live: s.presence == Presence::Live,
                    ..outlook
                }
            })
            .collect()
    }

    /// Hand the next micro-batch to every idle live trainer (Computing only).
    pub(super) fn dispatch(&mut self, now: Timestamp) -> Vec<Decision<E>> {
        let mut out = Vec::new();
        let steals = self.steals();
        for slot in 0..self.slots.len() {
            let computing = self
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Computing));
            if !computing || self.stopped.is_some() {
                break;
            }
            let s = &self.slots[slot];
            if s.presence != Presence::Live || s.busy.is_some() {
                continue;
            }
            let own = self
                .run
                .as_ref()
                .is_some_and(|r| r.attempt.queue.own(slot).next().is_some());
            // Estimates only when they are needed (a steal).
            let outlooks = if steals && !own {
                self.outlooks(now)
            } else {
                Vec::new()
            };
            let Some(run) = self.run.as_mut() else {
                break;
            };
            let a = &mut run.attempt;
            let (mb, origin, reason) = match a.queue.next_own(slot) {
                Some(mb) => (mb, slot, Reason::OwnList),
                None if steals => match a.queue.steal(slot, &outlooks) {
                    Some(st) => (
                        st.micro_batch,
                        st.from,
                        Reason::Stolen {
                            from: st.from as u32,
                            thief_finish: Duration::try_from_secs_f64(st.thief_finish)
                                .unwrap_or(Duration::MAX),
                            victim_finish: Duration::try_from_secs_f64(st.victim_finish).ok(),
                        },
                    ),
                    None => continue,
                },
                None => continue,
            };
            if let Err(refusal) = a.ledger.assign(mb, slot) {
                // Never drop work: put it back where it came from, then fail the step.
                a.queue.put_back(origin, mb);
                out.extend(self.refused(refusal));
                break;
            }
            let Some(micro_batch) = a.micro_batches.get(mb).cloned() else {
                // The queue named a micro-batch the plan does not have; the ledger refused
                // already (Unknown), so this is unreachable; never hand out nothing.
                break;
            };
            self.slots[slot].busy = Some(Busy {
                epoch: self.epoch,
                micro_batch: mb,
                since: now,
                cost: micro_batch.cost,
            });
            out.push(decision(
                Command::Assign {
                    slot: slot as u32,
                    assignment: Assignment {
                        token: self.key.token(self.epoch, micro_batch.id),
                        micro_batch,
                        epoch: self.epoch,
                        step: self.global_step(),
                    },
                },
                reason,
            ));
        }
        out.extend(self.expect_relays());
        out
    }

    /// Test-only: queue `micro_batch` a second time, at the front of `slot`'s list.
    #[cfg(test)]
    pub(super) fn double_queue(&mut self, slot: usize, micro_batch: usize) {
        if let Some(run) = self.run.as_mut() {
            run.attempt.queue.put_back(slot, micro_batch);
        }
    }

    /// Test-only: make the ledger believe `micro_batch` is held by `trainer` (which is not
    /// running it), while it is still in the queue.
    #[cfg(test)]
    pub(super) fn corrupt_ledger(&mut self, micro_batch: usize, trainer: usize) {
        if let Some(run) = self.run.as_mut() {
            run.attempt
                .ledger
                .assign(micro_batch, trainer)
                .expect("pending micro-batch");
        }
    }
}

/// A plan under construction with its pieces, in step.
struct Assembly {
    plan: Plan,
    pieces: Vec<Vec<Piece>>,
}

impl Assembly {
    fn new(trainers: usize) -> Self {
        Assembly {
            plan: Plan {
                micro_batches: Vec::new(),
                per_trainer: vec![Vec::new(); trainers],
            },
            pieces: Vec::new(),
        }
    }

    /// Appends `mb` (with its pieces) to `device`'s list.
    fn push(&mut self, device: usize, mb: PlannedMicroBatch, pieces: Vec<Piece>) {
        self.plan.per_trainer[device].push(self.plan.micro_batches.len());
        self.plan.micro_batches.push(mb);
        self.pieces.push(pieces);
    }
}

/// The modelled step of a lockstep plan: round `r` (every trainer's `r`-th micro-batch) lasts as
/// long as its costliest micro-batch.
pub(super) fn lockstep_s(plan: &Plan) -> f64 {
    let rounds = plan.per_trainer.iter().map(Vec::len).max().unwrap_or(0);
    (0..rounds)
        .map(|r| {
            plan.per_trainer
                .iter()
                .filter_map(|list| list.get(r))
                .filter_map(|&i| plan.micro_batches.get(i))
                .map(|mb| mb.cost)
                .fold(0.0, f64::max)
        })
        .sum()
}
