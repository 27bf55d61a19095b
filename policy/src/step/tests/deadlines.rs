//! Deadlines: a hung micro-batch fails the step and its trainer is killed.

use super::super::decision::Reason;
use super::*;
use crate::recovery::FailurePolicy;

#[test]
fn deadline_on_tick_fails_the_step_kills_the_hung_trainer_and_the_next_step_works() {
    let cfg = StepConfig {
        micro_batch_timeout: Duration::from_millis(500),
        ..config()
    };
    let mut w = World::new(cfg, &[1000.0, 1000.0]);
    assert_eq!(w.m.tick_period(), Duration::from_millis(50));
    w.hung[0] = true;
    let ds = w.m.start(samples(4, 100), w.now);
    w.apply(ds);
    let hung_mb = w.running[0].as_ref().map(|r| r.0.micro_batch.id).unwrap();
    while w.event() {}
    assert!(w.finished.is_none(), "the step waits for the hung trainer");
    assert!(w.m.on_tick(ms(400)).is_empty(), "not yet past the deadline");
    w.now = ms(501);
    let ds = w.m.on_tick(w.now);
    assert_eq!(names(&ds), ["discard", "kill", "respawn"]);
    let reason = Reason::MicroBatchDeadline {
        slot: 0,
        micro_batch: hung_mb,
        after: Duration::from_millis(501),
    };
    assert!(ds.iter().all(|d| d.reason == reason), "{ds:?}");
    w.hung[0] = false;
    w.apply(ds);
    let err = w.finish().expect("finishes").expect_err("deadline");
    match err {
        TestError::Step(StepError::Deadline {
            what,
            step: 0,
            trainer: Some(0),
            micro_batch: Some(mb),
            after_ms: 501,
        }) if what == "micro-batch" && mb == hung_mb => {}
        other => panic!("{other:?}"),
    }
    assert!(w.event(), "the respawned trainer starts");
    let stats = w
        .step(samples(4, 100))
        .expect("finishes")
        .expect("next step works");
    assert_eq!(stats.step, 0, "the failed step did not advance the version");
    assert!(stats.micro_batch_log.iter().any(|r| r.trainer == 0));
}

#[test]
fn a_trainer_hung_in_a_discarded_attempt_is_killed_too() {
    let cfg = StepConfig {
        micro_batch_timeout: Duration::from_millis(500),
        failure: FailurePolicy::Drop,
        ..config()
    };
    let mut m = StepMachine::new(cfg, 2, key());
    m.start(samples(2, 100), ms(0));
    // Trainer 1 fails; trainer 0 never reports its epoch-0 micro-batch.
    assert_eq!(
        names(&m.on_trainer_lost(1, "gone".into(), ms(1))),
        ["discard"]
    );
    assert!(
        m.on_discarded(Ok(()), ms(2)).is_empty(),
        "slot 0 is still busy"
    );
    let ds = m.on_tick(ms(600));
    // Not the current attempt: no deadline error, but the trainer is killed and, being
    // the last one, the replay is re-planned without it.
    assert_eq!(names(&ds), ["kill", "discard"]);
    let ds = m.on_discarded(Ok(()), ms(601));
    assert!(matches!(
        ds[0].command,
        Command::Finish(Err(TestError::Step(StepError::NoTrainers { .. })))
    ));
}
