//! The barrier with relayed pushes: `Flush` before `Reduce`, what the relays combined checked
//! against the ledger, and a disagreement discarded and replayed (I2).

use super::super::decision::Reason;
use super::*;
use crate::dispatch::Communication;

/// Two nodes of two trainers, one server on each.
fn plan() -> RelayPlan {
    RelayPlan {
        server_nodes: vec![0, 1],
        trainer_nodes: vec![0, 0, 1, 1],
    }
}

fn world(config: StepConfig) -> World {
    World::new(config, &[1.0; 4]).relayed(plan())
}

#[test]
fn the_barrier_flushes_the_relays_then_reduces_when_their_counts_agree() {
    let mut w = world(config());
    let stats = w.step(samples(8, 100)).expect("finishes").expect("ok");
    assert_eq!(
        names(&w.log)[9..],
        ["flush", "reduce", "apply", "finish"],
        "{:?}",
        names(&w.log)
    );
    assert!(matches!(
        w.log[9],
        Decision {
            command: Command::Flush {
                epoch: 0,
                next_epoch: 1
            },
            reason: Reason::LedgerComplete { micro_batches: 8 },
        }
    ));
    assert!(matches!(
        w.log[10],
        Decision {
            command: Command::Reduce { next_epoch: 1, .. },
            reason: Reason::RelaysFlushed { relays: 2 },
        }
    ));
    assert_eq!((stats.replays, w.m.epoch()), (0, 1));
    // Without relays the same step reduces straight away.
    let mut plain = World::new(config(), &[1.0; 4]);
    plain.step(samples(8, 100)).expect("finishes").expect("ok");
    assert!(!names(&plain.log).contains(&"flush"));
}

#[test]
fn a_relay_that_lost_doubled_or_misplaced_a_micro_batch_discards_the_attempt_and_replays() {
    let tampers: [(Tamper, &str); 3] = [
        (|c| c[0].micro_batches.truncate(1), "misses micro-batch"),
        (
            |c| {
                let theirs = c[1].micro_batches[0];
                c[0].micro_batches.push(theirs);
            },
            "of node 1 did",
        ),
        (|c| c[1].micro_batches.push(99), "does not count as done"),
    ];
    for (tamper, says) in tampers {
        let mut w = world(config());
        w.tamper.push_back(tamper);
        let stats = w.step(samples(8, 100)).expect("finishes").expect("ok");
        let discard = w
            .log
            .iter()
            .position(|d| d.command.name() == "discard")
            .expect("a discard");
        assert_eq!(names(&w.log)[discard - 1], "flush");
        match &w.log[discard].reason {
            Reason::RelayMismatch { mismatch } => {
                assert!(mismatch.to_string().contains(says), "{mismatch}")
            }
            other => panic!("{other:?}"),
        }
        // Replayed in a fresh epoch; its honest flush reduces once.
        assert_eq!(stats.replays, 1, "{says}");
        assert_eq!(names(&w.log).iter().filter(|n| **n == "reduce").count(), 1);
        assert_eq!(names(&w.log).iter().filter(|n| **n == "flush").count(), 2);
        assert_eq!(w.m.epoch(), 3, "flush 0→1, discard 1→2, flush 2→3");
    }
    // A relay that disagrees every time: the replays run out and the step fails.
    let mut w = world(StepConfig {
        max_replays: 1,
        ..config()
    });
    for _ in 0..2 {
        w.tamper.push_back(|c| c[1].micro_batches.clear());
    }
    let result = w.step(samples(8, 100)).expect("finishes");
    assert!(
        matches!(
            result,
            Err(TestError::Step(StepError::TooManyReplays {
                replays: 1,
                ..
            }))
        ),
        "{result:?}"
    );
}

#[test]
fn a_failed_flush_fails_the_step_and_a_trainer_lost_while_flushing_is_only_respawned() {
    let mut m = StepMachine::new(config(), 4, key()).with_relay(Some(plan()));
    let ds = m.start(samples(4, 100), ms(0));
    let mut flush = Vec::new();
    for (slot, a) in assigned(&ds) {
        flush.extend(m.on_report(ok_report(slot, &a, ms(0), ms(1)), ms(1)));
    }
    assert_eq!(names(&flush), ["flush"]);
    let ds = m.on_trainer_lost(3, "gone".into(), ms(2));
    assert_eq!(names(&ds), ["respawn"], "its gradients are in the relays");
    let ds = m.on_flushed(Err(TestError::User("owner refused".into())), ms(3));
    assert!(
        matches!(
            &ds[..],
            [Decision {
                command: Command::Finish(Err(TestError::User(_))),
                reason: Reason::ServerCallFailed { call: "flush" },
            }]
        ),
        "{ds:?}"
    );
    // An outcome for no flush changes nothing.
    assert!(m.on_flushed(Ok(Vec::new()), ms(4)).is_empty());
}

/// Every `ExpectRelays` of the log: (epoch, per node).
fn expected(log: &[Decision]) -> Vec<(u64, Vec<u32>)> {
    log.iter()
        .filter_map(|d| match &d.command {
            Command::ExpectRelays { epoch, per_node } => Some((*epoch, per_node.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn relays_hear_each_nodes_micro_batches_once_they_are_final() {
    // A static plan: at once, beside the first assignments (nothing is ever stolen).
    let mut w = world(config());
    w.step(samples(8, 100)).expect("finishes").expect("ok");
    assert_eq!(
        expected(&w.log),
        [(0, vec![4, 4])],
        "8 over 2 nodes of 2 trainers"
    );
    let first = names(&w.log).iter().position(|n| *n == "expect-relays");
    assert_eq!(
        first,
        Some(4),
        "after the 4 first assignments: {:?}",
        names(&w.log)
    );
    assert!(matches!(
        w.log[4].reason,
        Reason::NodeCountsFinal { epoch: 0 }
    ));
    // A replay plans again: the relays hear the new epoch's counts.
    let mut w = world(config());
    w.tamper.push_back(|c| c[0].micro_batches.clear());
    w.step(samples(8, 100)).expect("finishes").expect("ok");
    let epochs: Vec<u64> = expected(&w.log).iter().map(|(e, _)| *e).collect();
    assert_eq!(epochs, [0, 2], "the first attempt and its replay");
    // Dynamic dispatch: only once nothing is left to hand out or steal, counting what each
    // node's trainers ran and run (a trainer twice as fast takes more).
    let mut w = World::new(
        StepConfig {
            dispatch: DispatchMode::Dynamic,
            ..config()
        },
        &[2.0, 1.0, 1.0, 1.0],
    )
    .relayed(plan());
    w.step(samples(12, 100)).expect("finishes").expect("ok");
    let heard = expected(&w.log);
    assert_eq!(heard.len(), 1, "{:?}", names(&w.log));
    assert_eq!(heard[0].1.iter().sum::<u32>(), 12);
    let at = names(&w.log)
        .iter()
        .position(|n| *n == "expect-relays")
        .unwrap();
    let assigned_after = names(&w.log)[at..]
        .iter()
        .filter(|n| **n == "assign")
        .count();
    assert_eq!(
        assigned_after,
        0,
        "every micro-batch was handed out before: {:?}",
        names(&w.log)
    );
    let done_by = |node: u32| -> u32 {
        w.log
            .iter()
            .filter(|d| matches!(&d.command, Command::Assign { slot, .. } if plan().trainer_node(*slot) == Some(node)))
            .count() as u32
    };
    assert_eq!(heard[0].1, [done_by(0), done_by(1)]);
    // Collective mode pushes reduced pieces: its relays flush at the barrier only.
    let mut w = world(StepConfig {
        communication: Communication::Collective,
        ..config()
    });
    w.step(samples(8, 100)).expect("finishes").expect("ok");
    assert!(expected(&w.log).is_empty(), "{:?}", names(&w.log));
}
