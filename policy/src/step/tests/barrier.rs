//! A step through its barrier: the command sequence, clipping, the schedule, refused starts.

use super::super::decision::Reason;
use super::*;
use crate::schedule::LrSchedule;

/// A resumed job (`first_step` 10) applies the schedule's factor of global steps 10, 11, names
/// them in its stats, and still reads parameter version 0, 1 (I1 is about versions).
#[test]
fn apply_carries_the_schedule_factor_of_the_global_step() {
    let schedule = LrSchedule::WarmupCosine {
        warmup_steps: 20,
        total_steps: 40,
        min_ratio: 0.0,
    };
    let mut w = World::new(
        StepConfig {
            schedule,
            first_step: 10,
            ..config()
        },
        &[1.0],
    );
    for k in 0..2u64 {
        let stats = w.step(samples(2, 100)).expect("finishes").expect("ok");
        assert_eq!(stats.step, 10 + k);
        let scale = w.log.iter().find_map(|d| match d.command {
            Command::Apply { lr_scale, .. } => Some(lr_scale),
            _ => None,
        });
        assert_eq!(scale, Some(schedule.factor(10 + k)));
        let versions: Vec<u64> = w
            .log
            .iter()
            .filter_map(|d| match &d.command {
                Command::Assign { assignment, .. } => Some(assignment.micro_batch.step),
                _ => None,
            })
            .collect();
        assert!(
            !versions.is_empty() && versions.iter().all(|v| *v == k),
            "{versions:?}"
        );
    }
}

#[test]
fn normal_step_command_sequence() {
    let mut w = World::new(config(), &[1.0, 1.0]);
    let stats = w.step(samples(4, 100)).expect("finishes").expect("ok");
    assert_eq!(
        names(&w.log),
        ["assign", "assign", "assign", "assign", "reduce", "apply", "finish"]
    );
    assert!(w.log[..4].iter().all(|d| d.reason == Reason::OwnList));
    match &w.log[4] {
        Decision {
            command: Command::Reduce { scale, next_epoch },
            reason: Reason::LedgerComplete { micro_batches: 4 },
        } => assert_eq!((*scale, *next_epoch), (1.0 / 400.0, 1)),
        other => panic!("{other:?}"),
    }
    match &w.log[5] {
        Decision {
            command: Command::Apply { clip, version, .. },
            reason: Reason::GradientsReduced { grad_norm, .. },
        } => assert_eq!((*clip, *version, *grad_norm), (1.0, 1, 2.0)),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.log[6].reason, Reason::Applied { version: 1 });
    assert_eq!((stats.step, stats.replays, stats.micro_batches), (0, 0, 4));
    assert_eq!((stats.tokens, stats.samples, stats.loss), (400, 4, 1.0));
    assert_eq!(stats.micro_batch_log.len(), 4);
    assert_eq!(
        stats.trainers.iter().map(|t| t.micro_batches).sum::<u32>(),
        4
    );
    assert_eq!(
        stats.wall, stats.trainers[0].busy,
        "trainer 0 was busy all along"
    );
    assert_eq!((w.m.version(), w.m.epoch()), (1, 1));
    // I1: assignments of the next step carry the new version.
    let ds = w.m.start(samples(2, 100), w.now);
    assert!(assigned(&ds)
        .iter()
        .all(|(_, a)| a.micro_batch.step == 1 && a.epoch == 1));
}

#[test]
fn clipping_uses_the_global_norm() {
    let mut w = World::new(
        StepConfig {
            clip_norm: Some(1.0),
            ..config()
        },
        &[1.0],
    );
    w.step(samples(2, 100)).expect("finishes").expect("ok");
    let clip = w.log.iter().find_map(|d| match d.command {
        Command::Apply { clip, .. } => Some(clip),
        _ => None,
    });
    // Sum of squares 4 → norm 2 → clip 1 / (2 + 1e-6).
    assert_eq!(clip, Some(1.0 / (2.0 + 1e-6)));
}

#[test]
fn start_rejects_a_second_step_and_refuses_bad_minibatches() {
    let mut m = StepMachine::new(config(), 2, key());
    let ds = m.start(Vec::new(), ms(0));
    assert!(matches!(
        &ds[..],
        [Decision {
            command: Command::Finish(Err(TestError::Step(StepError::EmptyMinibatch { step: 0 }))),
            reason: Reason::Unplannable
        }]
    ));
    let ds = m.start(samples(1, 101), ms(0));
    assert!(matches!(
        ds[0].command,
        Command::Finish(Err(TestError::Step(StepError::Balance(_))))
    ));
    assert!(!m.is_running());
    assert_eq!(
        names(&m.start(samples(3, 100), ms(0))),
        ["assign", "assign"]
    );
    let ds = m.start(samples(3, 100), ms(1));
    assert!(matches!(
        ds[..],
        [Decision {
            command: Command::Reject(TestError::Step(StepError::Busy)),
            ..
        }]
    ));
    assert!(m.is_running());
}
