//! The machine's events: a step starts, reports arrive, servers answer, trainers and servers are
//! lost, time passes; and the moves they share (fail, discard, replay, finish).

use super::*;

impl<E: Failure> StepMachine<E> {
    /// A machine for `trainers` slots, all live (the actor spawned them), at version 0, epoch 0,
    /// whose assignment tokens are made with `key` (drawn at random by the caller).
    pub fn new(config: StepConfig, trainers: u32, key: JobKey) -> Self {
        let slots = vec![
            Slot {
                presence: Presence::Live,
                busy: None,
                respawns: 0,
            };
            trainers as usize
        ];
        StepMachine {
            config,
            key,
            speeds: SpeedEstimator::new(slots.len(), 0.5),
            slots,
            version: 0,
            skipped: 0,
            epoch: 0,
            run: None,
            stopped: None,
            relay: None,
        }
    }

    /// Pushes relayed through the node as `plan` places trainers and servers: every barrier
    /// flushes the relays and checks what they combined before it reduces.
    pub fn with_relay(mut self, plan: Option<RelayPlan>) -> Self {
        self.relay = plan;
        self
    }

    pub fn config(&self) -> &StepConfig {
        &self.config
    }

    /// Version of the parameters (optimizer steps applied).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The global step being trained: [`StepConfig::first_step`] plus the steps this machine
    /// finished, applied or skipped (what stats and errors name; the schedule's position).
    pub fn global_step(&self) -> u64 {
        self.config.first_step + self.version + self.skipped
    }

    /// Accumulator epoch of the current attempt.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A step is in flight.
    pub fn is_running(&self) -> bool {
        self.run.is_some()
    }

    /// How often the actor should call [`on_tick`](Self::on_tick): a tenth of the micro-batch
    /// timeout, at most 100 ms, at least 1 ms.
    pub fn tick_period(&self) -> Duration {
        (self.config.micro_batch_timeout / 10).clamp(Duration::from_millis(1), MAX_TICK)
    }

    /// A new minibatch. `Reject` if a step is running (it goes on) or the machine stopped;
    /// `Finish(Err)` if it cannot be planned; otherwise the first assignments.
    pub fn start(&mut self, samples: Vec<SampleMeta>, now: Timestamp) -> Vec<Decision<E>> {
        if let Some(e) = &self.stopped {
            return vec![decision(Command::Reject(e.clone()), Reason::NotAccepted)];
        }
        if self.run.is_some() {
            let e = StepError::Busy.into();
            return vec![decision(Command::Reject(e), Reason::NotAccepted)];
        }
        if samples.is_empty() {
            let e = StepError::EmptyMinibatch {
                step: self.global_step(),
            };
            return vec![decision(
                Command::Finish(Err(e.into())),
                Reason::Unplannable,
            )];
        }
        let attempt = match self.plan(&samples) {
            Ok(a) => a,
            Err(e) => {
                return vec![decision(
                    Command::Finish(Err(e.into())),
                    Reason::Unplannable,
                )]
            }
        };
        let total_weight = samples
            .iter()
            .map(|s| self.config.weighting.weight(s))
            .sum();
        self.run = Some(Run {
            samples,
            total_weight,
            attempt,
            phase: Phase::Computing,
            replays: 0,
            started: now,
        });
        self.dispatch(now)
    }

    /// A trainer's report of a micro-batch, success or error. A report that is not admitted
    /// (module docs, "Reports are bound to assignments") is answered with one `Ignore` and
    /// changes nothing.
    pub fn on_report(&mut self, report: TrainerReport<E>, now: Timestamp) -> Vec<Decision<E>> {
        if let Err(why) = self.admit(&report) {
            let reason = Reason::ReportRefused {
                trainer: report.trainer,
                micro_batch: report.micro_batch,
                epoch: report.epoch,
                why,
            };
            return vec![decision(Command::Ignore, reason)];
        }
        // Admitted: the slot was running exactly this micro-batch; it is idle now.
        let slot = report.trainer as usize;
        if let Some(s) = self.slots.get_mut(slot) {
            s.busy = None;
        }
        let current = self.stopped.is_none()
            && report.epoch == self.epoch
            && self
                .run
                .as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Computing));
        if !current {
            // A report of a discarded attempt (its gradients were discarded or refused at the
            // owners), or of no step: ignored, the trainer is idle.
            return self.dispatch(now);
        }
        let step = self.global_step();
        let mb = report.micro_batch as usize;
        let (output, io) = match report.result {
            Ok(done) => (done.output, done.stats),
            Err(e) => {
                if let Some(at) = e.non_finite() {
                    // Named by the report (the trainer and micro-batch the ledger knows) and
                    // the global step.
                    let at = NonFiniteAt {
                        step,
                        trainer: Some(report.trainer),
                        micro_batch: Some(report.micro_batch),
                        ..at.clone()
                    };
                    let reason = Reason::NonFiniteMicroBatch {
                        slot: slot as u32,
                        micro_batch: report.micro_batch,
                        policy: self.config.non_finite,
                    };
                    return self.non_finite(at, reason, f64::NAN).into_iter().collect();
                }
                let reason = Reason::MicroBatchFailed {
                    slot: slot as u32,
                    micro_batch: mb as u32,
                };
                let error = e.in_micro_batch(step, report.micro_batch, report.trainer);
                return self.fail(error, reason).into_iter().collect();
            }
        };
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let a = &mut run.attempt;
        if let Err(refusal) = a.ledger.complete(mb, slot) {
            return self.refused(refusal);
        }
        let (tokens, cost, pieces) = a.micro_batches.get(mb).map_or((0, 0.0, Vec::new()), |m| {
            (m.tokens, m.cost, m.pieces.clone())
        });
        a.loss_sum += output.loss_sum;
        let busy = report.finished.saturating_duration_since(report.started);
        self.speeds.observe(slot, cost, busy.as_secs_f64());
        if let Some(t) = a.trainers.get_mut(slot) {
            t.busy += busy;
            t.pull_wait += io.pull_wait;
            t.micro_batches += 1;
            t.tokens += tokens;
            t.peak_gathered = t.peak_gathered.max(io.peak_gathered);
            t.bytes_pulled += io.bytes_pulled;
            t.bytes_pushed += io.bytes_pushed;
        }
        a.log.push(MicroBatchRecord {
            micro_batch: report.micro_batch,
            trainer: report.trainer,
            started: report.started,
            finished: report.finished,
            tokens,
            cost,
            spans: io.spans,
            pieces,
        });
        if !a.ledger.is_complete() {
            return self.dispatch(now);
        }
        let micro_batches = a.ledger.len() as u32;
        let epoch = a.epoch;
        // The barrier: I1, every micro-batch of step v is in; nobody has step-v work.
        let scale = if run.total_weight > 0.0 {
            1.0 / run.total_weight
        } else {
            0.0
        };
        self.epoch += 1;
        if self.relay.is_some() {
            run.phase = Phase::Flushing { scale };
            return vec![decision(
                Command::Flush {
                    epoch,
                    next_epoch: self.epoch,
                },
                Reason::LedgerComplete { micro_batches },
            )];
        }
        run.phase = Phase::Reducing;
        vec![decision(
            Command::Reduce {
                scale,
                next_epoch: self.epoch,
            },
            Reason::LedgerComplete { micro_batches },
        )]
    }

    /// Whether `report` answers an assignment of this machine: its token is the one of its
    /// (epoch, micro-batch) and its trainer is running that micro-batch of that epoch.
    pub(super) fn admit(&self, report: &TrainerReport<E>) -> Result<(), ReportRefusal> {
        let Some(s) = self.slots.get(report.trainer as usize) else {
            return Err(ReportRefusal::UnknownTrainer);
        };
        if !self
            .key
            .admits(report.epoch, report.micro_batch, report.token)
        {
            return Err(ReportRefusal::WrongToken);
        }
        let mb = report.micro_batch as usize;
        if s.busy
            .is_some_and(|b| b.epoch == report.epoch && b.micro_batch == mb)
        {
            return Ok(());
        }
        let counted = self.run.as_ref().is_some_and(|r| {
            r.attempt.epoch == report.epoch
                && r.attempt.ledger.done_by(mb) == Some(report.trainer as usize)
        });
        if counted {
            Err(ReportRefusal::Duplicate)
        } else {
            Err(ReportRefusal::NotRunning)
        }
    }

    /// The trainer in `slot` is gone (failed, stopped, unreachable, or its respawn failed).
    pub fn on_trainer_lost(
        &mut self,
        slot: u32,
        reason: String,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        self.lost(slot as usize, Reason::TrainerLost { slot, reason })
    }

    /// A respawned trainer is up in `slot`.
    pub fn on_trainer_started(&mut self, slot: u32, now: Timestamp) -> Vec<Decision<E>> {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        s.presence = Presence::Live;
        s.busy = None;
        self.dispatch(now)
    }

    /// Every server flushed its relays (`Ok`: what each relay combined) or one failed. Counts
    /// that agree with the ledger lead to `Reduce`; a disagreement discards the attempt and
    /// replays it (module docs); a failed flush fails the step, as a failed reduce does.
    pub fn on_flushed(
        &mut self,
        result: Result<Vec<Combined>, E>,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let Phase::Flushing { scale } = run.phase else {
            return Vec::new();
        };
        let combined = match result {
            Ok(combined) => combined,
            Err(e) => return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "flush" })],
        };
        let ledger = &run.attempt.ledger;
        let every_micro_batch_pushes = self.config.communication == Communication::OnDemand;
        let checked = self.relay.as_ref().map_or(Ok(()), |plan| {
            plan.check_combined(
                ledger.len() as u32,
                |mb| ledger.done_by(mb as usize).map(|t| t as u32),
                &combined,
                every_micro_batch_pushes,
            )
        });
        match checked {
            Ok(()) => {
                run.phase = Phase::Reducing;
                run.attempt.early_relay_flushes =
                    combined.iter().filter(|c| c.early).count() as u32;
                vec![decision(
                    Command::Reduce {
                        scale,
                        next_epoch: self.epoch,
                    },
                    Reason::RelaysFlushed {
                        relays: combined.len() as u32,
                    },
                )]
            }
            Err(mismatch) => {
                let why = Reason::RelayMismatch { mismatch };
                self.discard(AfterDiscard::Replay, why)
                    .into_iter()
                    .collect()
            }
        }
    }

    /// Every server reduced (`Ok`: the sum over servers of their sums of squares) or one failed.
    pub fn on_reduced(&mut self, result: Result<f64, E>, now: Timestamp) -> Vec<Decision<E>> {
        let _ = now;
        let lr_scale = self.config.schedule.factor(self.global_step());
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        if !matches!(run.phase, Phase::Reducing) {
            return Vec::new();
        }
        let sum_sq = match result {
            Ok(v) => v,
            Err(e) => return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "reduce" })],
        };
        if !sum_sq.is_finite() {
            // Checked before anything compares it: `max(0.0)` would turn NaN into 0 (clip
            // factor 1), and an infinite norm gives a clip factor of 0 and NaN through inf × 0.
            let value = sum_sq.to_string();
            let at = NonFiniteAt {
                what: "global gradient norm".into(),
                step: self.global_step(),
                trainer: None,
                micro_batch: None,
                samples: Vec::new(),
                unit: None,
                element: None,
                value: value.clone(),
            };
            let reason = Reason::NonFiniteGradNorm {
                value,
                policy: self.config.non_finite,
            };
            return self
                .non_finite(at, reason, sum_sq.sqrt())
                .into_iter()
                .collect();
        }
        // Finite, and a sum of squares: never negative but for a misbehaving server.
        let grad_norm = sum_sq.max(0.0).sqrt();
        let clip = match self.config.clip_norm {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let version = self.version + 1;
        run.phase = Phase::Applying { grad_norm, version };
        vec![decision(
            Command::Apply {
                clip,
                lr_scale,
                version,
            },
            Reason::GradientsReduced { grad_norm, clip },
        )]
    }

    /// Every server applied and published, or one failed.
    pub fn on_applied(&mut self, result: Result<(), E>, now: Timestamp) -> Vec<Decision<E>> {
        let Some(run) = self.run.as_ref() else {
            return Vec::new();
        };
        let Phase::Applying { grad_norm, version } = run.phase else {
            return Vec::new();
        };
        if let Err(e) = result {
            return vec![self.finish(Err(e), Reason::ServerCallFailed { call: "apply" })];
        }
        let step = self.global_step();
        self.version = version;
        let Some(run) = self.run.take() else {
            return Vec::new();
        };
        let stats = run.stats(step, grad_norm, now);
        vec![decision(
            Command::Finish(Ok(stats)),
            Reason::Applied { version },
        )]
    }

    /// Every server discarded the attempt, or one failed.
    pub fn on_discarded(&mut self, result: Result<(), E>, now: Timestamp) -> Vec<Decision<E>> {
        let Some(run) = self.run.as_mut() else {
            return Vec::new();
        };
        let Phase::Discarding(then) = std::mem::replace(&mut run.phase, Phase::Computing) else {
            return Vec::new();
        };
        match (result, then) {
            (Err(e), _) => vec![self.finish(Err(e), Reason::ServerCallFailed { call: "discard" })],
            (Ok(()), AfterDiscard::Fail { error, reason }) => vec![self.finish(Err(error), reason)],
            (Ok(()), AfterDiscard::Replay) => self.replay(now),
            (
                Ok(()),
                AfterDiscard::Skip {
                    why,
                    reason,
                    grad_norm,
                },
            ) => {
                let step = self.global_step();
                self.skipped += 1;
                let Some(run) = self.run.take() else {
                    return Vec::new();
                };
                let stats = StepStats {
                    skipped: Some(why),
                    ..run.stats(step, grad_norm, now)
                };
                vec![decision(Command::Finish(Ok(stats)), reason)]
            }
        }
    }

    /// A shard server is gone: its shard is lost; the step fails and the supervisor stops.
    pub fn on_server_lost(
        &mut self,
        endpoint: u32,
        reason: String,
        now: Timestamp,
    ) -> Vec<Decision<E>> {
        let _ = now;
        if self.stopped.is_some() {
            return Vec::new();
        }
        let error: E = StepError::Actor {
            actor: format!("shard server {endpoint}"),
            reason: reason.clone(),
        }
        .into();
        let why = Reason::ServerLost { endpoint, reason };
        let mut out = Vec::new();
        if self.run.is_some() {
            out.push(self.finish(Err(error.clone()), why.clone()));
        }
        self.stopped = Some(error.clone());
        out.push(decision(Command::Stop(error), why));
        out
    }

    /// Time passed: enforce the micro-batch deadline (I6). A micro-batch of the running attempt
    /// past `micro_batch_timeout` fails the step (`Discard`, then `Finish(Err(Deadline))`); every
    /// trainer past it (also one still running a discarded attempt) is killed and respawned per
    /// policy, so the next step has it back.
    pub fn on_tick(&mut self, now: Timestamp) -> Vec<Decision<E>> {
        let mut out = Vec::new();
        if self.stopped.is_some() {
            return out;
        }
        let timeout = self.config.micro_batch_timeout;
        for slot in 0..self.slots.len() {
            let s = &self.slots[slot];
            let Some(busy) = s.busy.filter(|_| s.presence == Presence::Live) else {
                continue;
            };
            let ran = now.saturating_duration_since(busy.since);
            if ran <= timeout {
                continue;
            }
            let reason = Reason::MicroBatchDeadline {
                slot: slot as u32,
                micro_batch: busy.micro_batch as u32,
                after: ran,
            };
            let current = busy.epoch == self.epoch
                && self
                    .run
                    .as_ref()
                    .is_some_and(|r| matches!(r.phase, Phase::Computing));
            if current {
                let error = StepError::Deadline {
                    what: "micro-batch".into(),
                    step: self.global_step(),
                    trainer: Some(slot as u32),
                    micro_batch: Some(busy.micro_batch as u32),
                    after_ms: millis(ran),
                };
                out.extend(self.fail(error.into(), reason.clone()));
            }
            out.push(decision(
                Command::Kill { slot: slot as u32 },
                reason.clone(),
            ));
            out.extend(self.lost(slot, reason));
        }
        out
    }

    /// `slot` is lost: respawn it per policy; if it was live while computing, discard the
    /// attempt and replay (I2: whatever it pushed of this attempt is dropped at the owners, and
    /// its list is planned again for the trainers left).
    pub(super) fn lost(&mut self, slot: usize, why: Reason) -> Vec<Decision<E>> {
        let mut out = Vec::new();
        let Some(s) = self.slots.get_mut(slot) else {
            return out;
        };
        let was_live = match s.presence {
            Presence::Gone => return out,
            Presence::Live => true,
            Presence::Respawning => false,
        };
        s.busy = None;
        self.speeds.reset(slot);
        match slot_fate(self.config.failure, s.respawns) {
            SlotFate::Respawn { respawn } => {
                s.respawns = respawn;
                s.presence = Presence::Respawning;
                out.push(decision(
                    Command::Respawn { slot: slot as u32 },
                    why.clone(),
                ));
            }
            SlotFate::Drop => s.presence = Presence::Gone,
        }
        let computing = self
            .run
            .as_ref()
            .is_some_and(|r| matches!(r.phase, Phase::Computing));
        if must_replay(was_live, computing) && self.stopped.is_none() {
            out.extend(self.discard(AfterDiscard::Replay, why));
        }
        out
    }

    /// Fail the step: discard the attempt, then `Finish(Err(error))`.
    pub(super) fn fail(&mut self, error: E, reason: Reason) -> Option<Decision<E>> {
        let then = AfterDiscard::Fail {
            error,
            reason: reason.clone(),
        };
        self.discard(then, reason)
    }

    /// Non-finite gradients (`at` says where, `grad_norm` is the barrier's or NaN): discard
    /// the attempt, then fail or skip the step per [`StepConfig::non_finite`].
    pub(super) fn non_finite(
        &mut self,
        at: NonFiniteAt,
        reason: Reason,
        grad_norm: f64,
    ) -> Option<Decision<E>> {
        let at = Box::new(at);
        let then = match self.config.non_finite {
            NonFinite::Error => AfterDiscard::Fail {
                error: StepError::NonFinite(at).into(),
                reason: reason.clone(),
            },
            NonFinite::SkipStep => AfterDiscard::Skip {
                why: at,
                reason: reason.clone(),
                grad_norm,
            },
        };
        self.discard(then, reason)
    }

    /// Discard the attempt: new epoch, phase `Discarding(then)`. `None` without a run or while
    /// already discarding (the first outcome decides).
    pub(super) fn discard(&mut self, then: AfterDiscard<E>, reason: Reason) -> Option<Decision<E>> {
        let run = self.run.as_mut()?;
        if matches!(run.phase, Phase::Discarding(_)) {
            return None;
        }
        run.phase = Phase::Discarding(then);
        self.epoch += 1;
        Some(decision(
            Command::Discard {
                next_epoch: self.epoch,
            },
            reason,
        ))
    }

    /// The ledger refused: the machine's state is inconsistent (reports reach the ledger only once
    /// admitted, so no peer causes this). Fail the step (nothing is dropped).
    pub(super) fn refused(&mut self, refusal: LedgerError) -> Vec<Decision<E>> {
        let reason = Reason::LedgerRefused {
            refusal: refusal.clone(),
        };
        let error = StepError::Ledger {
            step: self.global_step(),
            source: refusal,
        };
        self.fail(error.into(), reason).into_iter().collect()
    }

    /// End the step with `result`.
    pub(super) fn finish(&mut self, result: Result<StepStats, E>, reason: Reason) -> Decision<E> {
        self.run = None;
        decision(Command::Finish(result), reason)
    }

    /// After a discard for a lost trainer: re-plan and hand everything out again.
    pub(super) fn replay(&mut self, now: Timestamp) -> Vec<Decision<E>> {
        let Some(mut run) = self.run.take() else {
            return Vec::new();
        };
        if !may_replay(run.replays, self.config.max_replays) {
            let replays = run.replays;
            let e = StepError::TooManyReplays {
                step: self.global_step(),
                replays,
            };
            return vec![self.finish(Err(e.into()), Reason::TooManyReplays { replays })];
        }
        run.replays += 1;
        run.attempt = match self.plan(&run.samples) {
            Ok(a) => a,
            Err(e) => return vec![self.finish(Err(e.into()), Reason::Unplannable)],
        };
        run.phase = Phase::Computing;
        self.run = Some(run);
        self.dispatch(now)
    }

    /// With relays on demand, once each node's micro-batches of the running attempt are final
    /// (a static plan: at once, nothing is stolen; a dynamic one: when nothing is left to hand
    /// out or steal), tell the servers how many each node runs ([`Command::ExpectRelays`]),
    /// once per attempt: its relays may then flush as soon as their writes are in.
    pub(super) fn expect_relays(&mut self) -> Option<Decision<E>> {
        let plan = self.relay.as_ref()?;
        if self.config.communication != Communication::OnDemand {
            return None;
        }
        let run = self.run.as_mut()?;
        let a = &mut run.attempt;
        if a.relays_expected || !matches!(run.phase, Phase::Computing) {
            return None;
        }
        if self.config.dispatch == DispatchMode::Dynamic && a.queue.remaining() > 0 {
            return None;
        }
        a.relays_expected = true;
        let nodes = plan
            .trainer_nodes
            .iter()
            .copied()
            .max()
            .map_or(0, |n| n + 1);
        let mut per_node = vec![0u32; nodes as usize];
        let node_of = |slot: usize| plan.trainer_nodes.get(slot).map(|&n| n as usize);
        for slot in 0..plan.trainer_nodes.len() {
            if let Some(node) = node_of(slot) {
                per_node[node] += a.queue.own(slot).count() as u32;
            }
        }
        for mb in 0..a.ledger.len() {
            if let Some(node) = a.ledger.trainer_of(mb).and_then(node_of) {
                per_node[node] += 1;
            }
        }
        let epoch = a.epoch;
        Some(decision(
            Command::ExpectRelays { epoch, per_node },
            Reason::NodeCountsFinal { epoch },
        ))
    }
}
