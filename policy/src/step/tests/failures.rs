//! Failures: lost trainers (replay, drop), failed micro-batches, lost servers, failed server calls, ledger refusals.

use super::super::decision::Reason;
use super::*;
use crate::ledger::LedgerError;
use crate::recovery::FailurePolicy;

#[test]
fn replay_after_a_trainer_failure_hands_everything_out_again() {
    let mut w = World::new(config(), &[1.0, 1.0]);
    let first = w.m.start(samples(6, 100), w.now);
    w.apply(first);
    assert!(w.event(), "one report");
    // Trainer 1 fails while computing: respawn, discard.
    w.running[1] = None;
    let ds = w.m.on_trainer_lost(1, "panicked".into(), w.now);
    let lost = Reason::TrainerLost {
        slot: 1,
        reason: "panicked".into(),
    };
    assert_eq!(names(&ds), ["respawn", "discard"]);
    assert!(ds.iter().all(|d| d.reason == lost));
    assert!(matches!(ds[1].command, Command::Discard { next_epoch: 1 }));
    let from = w.log.len();
    w.apply(ds);
    let stats = w.finish().expect("finishes").expect("replayed");
    assert_eq!(stats.replays, 1);
    // Every micro-batch handed out exactly once in the replay's epoch.
    let mut replayed: Vec<u32> = assigned(&w.log[from..])
        .iter()
        .filter(|(_, a)| a.epoch == 1)
        .map(|(_, a)| a.micro_batch.id)
        .collect();
    replayed.sort_unstable();
    assert_eq!(replayed, (0..6).collect::<Vec<_>>());
    assert_eq!(stats.micro_batch_log.len(), 6);
    assert_eq!(
        stats.loss, 1.0,
        "the discarded attempt's loss does not count"
    );
}

#[test]
fn too_many_replays_fail_the_step() {
    let mut w = World::new(
        StepConfig {
            max_replays: 1,
            ..config()
        },
        &[1.0, 1.0],
    );
    let ds = w.m.start(samples(4, 100), w.now);
    w.apply(ds);
    for attempt in 0..2 {
        w.running[0] = None;
        let ds = w.m.on_trainer_lost(0, format!("failure {attempt}"), w.now);
        assert_eq!(names(&ds), ["respawn", "discard"]);
        w.apply(ds);
        while !w.pending.is_empty() {
            w.event();
        }
    }
    let ds = w.log.last().expect("a decision");
    assert!(
        matches!(
            ds,
            Decision {
                command: Command::Finish(Err(TestError::Step(StepError::TooManyReplays {
                    step: 0,
                    replays: 1
                }))),
                reason: Reason::TooManyReplays { replays: 1 },
            }
        ),
        "{ds:?}"
    );
    assert!(!w.m.is_running());
}

#[test]
fn reports_of_discarded_epochs_are_ignored() {
    let mut m = StepMachine::new(config(), 2, key());
    let first = assigned(&m.start(samples(4, 100), ms(0)));
    let (slot0, a0) = first[0].clone();
    assert_eq!(slot0, 0);
    let ds = m.on_trainer_lost(1, "gone".into(), ms(10));
    assert_eq!(names(&ds), ["respawn", "discard"]);
    // While discarding: trainer 0's report of epoch 0 is ignored, nothing is decided.
    let late = ok_report(0, &a0, ms(0), ms(20));
    assert!(m.on_report(late, ms(20)).is_empty());
    assert!(
        m.on_trainer_started(1, ms(21)).is_empty(),
        "no work while discarding"
    );
    let replay = assigned(&m.on_discarded(Ok(()), ms(30)));
    assert_eq!(replay.len(), 2);
    assert!(replay.iter().all(|(_, a)| a.epoch == 1));
    // A duplicate of the old report after the replay started: ignored again; the ledger of
    // the replay is untouched (no barrier after the replay's own reports only when all in).
    let again = ok_report(0, &a0, ms(0), ms(20));
    assert!(
        assigned(&m.on_report(again, ms(31))).is_empty(),
        "slot 0 is busy"
    );
    let mut now = 40;
    let mut queue: Vec<(u32, Assignment)> = replay;
    let mut reduce = None;
    while let Some((slot, a)) = queue.pop() {
        now += 1;
        let ds = m.on_report(ok_report(slot, &a, ms(now - 1), ms(now)), ms(now));
        reduce = reduce.or(ds.iter().find(|d| d.command.name() == "reduce").cloned());
        queue.extend(assigned(&ds));
    }
    assert!(matches!(
        reduce,
        Some(Decision {
            command: Command::Reduce { next_epoch: 2, .. },
            reason: Reason::LedgerComplete { micro_batches: 4 }
        })
    ));
}

#[test]
fn a_failure_during_the_barrier_only_respawns() {
    for phase in ["reduce", "apply"] {
        let mut w = World::new(config(), &[1.0, 1.0]);
        let ds = w.m.start(samples(2, 100), w.now);
        w.apply(ds);
        while !w.log.iter().any(|d| d.command.name() == "reduce") {
            assert!(w.event());
        }
        if phase == "apply" {
            assert!(w.event());
            assert_eq!(w.log.last().map(|d| d.command.name()), Some("apply"));
        }
        let ds = w.m.on_trainer_lost(0, "late panic".into(), w.now);
        assert_eq!(names(&ds), ["respawn"], "{phase}: every gradient landed");
        w.apply(ds);
        let stats = w.finish().expect("finishes").expect("ok");
        assert_eq!(stats.replays, 0);
        assert_eq!(w.m.version(), 1);
    }
}

#[test]
fn drop_policy_continues_without_the_trainer() {
    let mut w = World::new(
        StepConfig {
            failure: FailurePolicy::Drop,
            ..config()
        },
        &[1.0, 1.0, 1.0],
    );
    let ds = w.m.start(samples(6, 100), w.now);
    w.apply(ds);
    w.running[2] = None;
    let ds = w.m.on_trainer_lost(2, "gone".into(), w.now);
    assert_eq!(names(&ds), ["discard"]);
    w.apply(ds);
    let stats = w.finish().expect("finishes").expect("ok");
    assert!(stats.micro_batch_log.iter().all(|r| r.trainer != 2));
    // Losing the last ones: the replay cannot be planned.
    let ds = w.m.start(samples(2, 100), w.now);
    w.apply(ds);
    w.running = vec![None; 3];
    for slot in [0, 1] {
        let ds = w.m.on_trainer_lost(slot, "gone".into(), w.now);
        w.apply(ds);
    }
    let r = w.finish().expect("finishes");
    assert!(
        matches!(r, Err(TestError::Step(StepError::NoTrainers { step: 1 }))),
        "{r:?}"
    );
}

#[test]
fn micro_batch_error_discards_then_fails_and_the_next_step_works() {
    let mut m = StepMachine::new(config(), 1, key());
    let (_, a) = assigned(&m.start(samples(2, 100), ms(0)))[0].clone();
    let mut report = ok_report(0, &a, ms(0), ms(5));
    report.result = Err(TestError::User("nan loss".into()));
    let ds = m.on_report(report, ms(5));
    assert_eq!(names(&ds), ["discard"]);
    assert_eq!(
        ds[0].reason,
        Reason::MicroBatchFailed {
            slot: 0,
            micro_batch: a.micro_batch.id
        }
    );
    let ds = m.on_discarded(Ok(()), ms(6));
    assert!(matches!(
        &ds[..],
        [Decision {
            command: Command::Finish(Err(TestError::MicroBatch {
                step: 0,
                trainer: 0,
                ..
            })),
            ..
        }]
    ));
    let mut w = World {
        m,
        ..World::new(config(), &[1.0])
    };
    assert!(w.step(samples(2, 100)).expect("finishes").is_ok());
}

#[test]
fn server_lost_stops_naming_the_server() {
    let mut m = StepMachine::new(config(), 2, key());
    m.start(samples(2, 100), ms(0));
    let ds = m.on_server_lost(2, "panicked".into(), ms(1));
    assert_eq!(names(&ds), ["finish", "stop"]);
    let named = |e: &TestError| matches!(e, TestError::Step(StepError::Actor { actor, .. }) if actor == "shard server 2");
    assert!(matches!(&ds[0].command, Command::Finish(Err(e)) if named(e)));
    assert!(matches!(&ds[1].command, Command::Stop(e) if named(e)));
    assert_eq!(
        ds[1].reason,
        Reason::ServerLost {
            endpoint: 2,
            reason: "panicked".into()
        }
    );
    assert!(matches!(
        &m.start(samples(2, 100), ms(2))[..],
        [Decision {
            command: Command::Reject(_),
            ..
        }]
    ));
    assert!(m.on_tick(ms(10_000_000)).is_empty());
    // Without a step: only the stop.
    let mut idle = StepMachine::new(config(), 1, key());
    assert_eq!(names(&idle.on_server_lost(0, "x".into(), ms(0))), ["stop"]);
}

#[test]
fn server_call_failures_fail_the_step() {
    let mut w = World::new(config(), &[1.0]);
    let ds = w.m.start(samples(1, 100), w.now);
    w.apply(ds);
    assert!(w.event());
    let e = TestError::Step(StepError::Actor {
        actor: "shard server 0 reduce".into(),
        reason: "timeout".into(),
    });
    let ds = w.m.on_reduced(Err(e), w.now);
    assert_eq!(ds[0].reason, Reason::ServerCallFailed { call: "reduce" });
    assert!(!w.m.is_running());
    // Stale outcomes change nothing.
    assert!(w.m.on_applied(Ok(()), w.now).is_empty());
    assert!(w.m.on_discarded(Ok(()), w.now).is_empty());
}

#[test]
fn ledger_refusal_of_a_double_queued_micro_batch_fails_the_step_instead_of_dropping_it() {
    let mut w = World::new(config(), &[1.0, 1.0]);
    let ds = w.m.start(samples(4, 100), w.now);
    let first = assigned(&ds);
    w.apply(ds);
    // Micro-batch of trainer 0 queued again at the front of trainer 1's list.
    w.m.double_queue(1, first[0].1.micro_batch.id as usize);
    let result = w.finish().expect("the step finishes");
    match result {
        Err(TestError::Step(StepError::Ledger {
            step: 0,
            source: LedgerError::NotPending { trainer: 1, .. },
        })) => {}
        other => panic!("{other:?}"),
    }
    assert!(w
        .log
        .iter()
        .any(|d| matches!(d.reason, Reason::LedgerRefused { .. })));
    // The machine is consistent again: the next step works.
    assert!(w.step(samples(4, 100)).expect("finishes").is_ok());
}

#[test]
fn ledger_refusal_of_the_only_copy_fails_the_step_instead_of_hanging() {
    // The old supervisor logged a refused hand-out and dropped the micro-batch: the ledger
    // then never completes and the step hangs. The machine fails it with a typed error.
    let mut w = World::new(config(), &[1.0, 1.0]);
    let ds = w.m.start(samples(4, 100), w.now);
    w.apply(ds);
    let queued = w.m.run.as_ref().and_then(|r| r.attempt.queue.own(0).next());
    let queued = queued.expect("trainer 0 has a second micro-batch");
    w.m.corrupt_ledger(queued, 7);
    let result = w.finish().expect("the step finishes, it does not stall");
    assert!(
        matches!(
            result,
            Err(TestError::Step(StepError::Ledger { step: 0, .. }))
        ),
        "{result:?}"
    );
    // It was put back, not dropped.
    assert!(w.m.run.is_none());
}
