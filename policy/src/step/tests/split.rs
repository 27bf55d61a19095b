//! Sequence splitting in the step machine: a gang's pieces, one per member, pinned to their
//! members, the split sample counted once; nothing changes where nothing is split.

use super::super::decision::Reason;
use super::*;
use crate::batch::Piece;
use crate::dispatch::Communication;
use crate::split::{ContextParallel, SplitPolicy};

fn split_config(split: SplitPolicy) -> StepConfig {
    StepConfig {
        dispatch: DispatchMode::Dynamic,
        cost: CostModel::odc_7b(),
        token_budget: 65_536,
        split,
        ..StepConfig::default()
    }
}

/// One sample of `long` tokens among `short` samples of 2,000.
fn long_tail(long: u64, short: u64) -> Vec<SampleMeta> {
    let mut s = vec![SampleMeta::new(0, long)];
    s.extend((1..=short).map(|i| SampleMeta::new(i, 2000)));
    s
}

/// Every assignment of a step: slot, micro-batch, why.
fn assignments(log: &[Decision]) -> Vec<(u32, MicroBatch, Reason)> {
    log.iter()
        .filter_map(|d| match &d.command {
            Command::Assign { slot, assignment } => {
                Some((*slot, assignment.micro_batch.clone(), d.reason.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_long_sample_runs_as_one_piece_on_each_member_of_its_gang_and_counts_once() {
    for speeds in [vec![1.0; 4], vec![1.0, 0.05, 1.0, 1.0]] {
        let mut w = World::new(split_config(SplitPolicy::Auto), &speeds);
        let samples = long_tail(60_000, 30);
        let total: u64 = samples.iter().map(|s| s.tokens).sum();
        let stats = w.step(samples).expect("finished").expect("ok");
        assert_eq!(stats.gangs.len(), 1, "{:?}", stats.gangs);
        let k = stats.gangs[0];
        assert!(k >= 2);
        let runs = assignments(&w.log);
        let pieces: Vec<_> = runs
            .iter()
            .filter(|(_, mb, _)| !mb.pieces.is_empty())
            .collect();
        assert_eq!(pieces.len(), k as usize);
        let mut members: Vec<u32> = pieces
            .iter()
            .map(|(_, mb, _)| mb.pieces[0].member)
            .collect();
        members.sort_unstable();
        assert_eq!(members, (0..k).collect::<Vec<_>>());
        let mut slots: Vec<u32> = pieces.iter().map(|(slot, _, _)| *slot).collect();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), k as usize, "members on distinct trainers");
        for (slot, mb, reason) in &pieces {
            let p = mb.pieces[0].clone();
            // Each member's trainer, as every member sees the gang: where its exchange goes.
            assert_eq!(p.ranks.len(), k as usize);
            assert_eq!(p.ranks[p.member as usize], *slot);
            assert_eq!(p.sample, SampleMeta::new(0, 60_000));
            assert_eq!(p.members, k);
            assert!(mb.samples.is_empty());
            // Pinned: a piece runs on its own member, never stolen (even from a slow one).
            assert!(matches!(reason, Reason::OwnList), "{reason:?}");
        }
        // The pieces' tokens are the sample's; the loss (each report's loss sum is its
        // micro-batch's tokens) divides by the minibatch's weight once: exactly 1.
        let piece_tokens: u64 = pieces.iter().map(|(_, mb, _)| mb.tokens).sum();
        assert_eq!(piece_tokens, 60_000);
        assert_eq!(runs.iter().map(|(_, mb, _)| mb.tokens).sum::<u64>(), total);
        assert!((stats.loss - 1.0).abs() < 1e-12, "{}", stats.loss);
        assert_eq!(stats.micro_batches as usize, runs.len());
    }
}

#[test]
fn nothing_changes_where_nothing_is_split() {
    let balanced: Vec<SampleMeta> = (0..64).map(|i| SampleMeta::new(i, 2000)).collect();
    let run = |split, samples: Vec<SampleMeta>| {
        let mut w = World::new(split_config(split), &[1.0; 4]);
        let stats = w.step(samples).expect("finished").expect("ok");
        (stats.gangs.clone(), assignments(&w.log))
    };
    let (gangs, auto) = run(SplitPolicy::Auto, balanced.clone());
    assert!(gangs.is_empty());
    assert_eq!(auto, run(SplitPolicy::Off, balanced).1);
    // A long tail with splitting off, or only for longer samples than it has: no gang.
    let (off, _) = run(SplitPolicy::Off, long_tail(60_000, 30));
    assert!(off.is_empty());
    let (above, _) = run(SplitPolicy::MinTokens(100_000), long_tail(60_000, 30));
    assert!(above.is_empty());
}

#[test]
fn gangs_stay_within_max_gang() {
    let mut w = World::new(
        StepConfig {
            max_gang: 2,
            ..split_config(SplitPolicy::Auto)
        },
        &[1.0; 4],
    );
    let stats = w
        .step(long_tail(120_000, 10))
        .expect("finished")
        .expect("ok");
    assert!(!stats.gangs.is_empty());
    assert!(stats.gangs.iter().all(|&k| k == 2), "{:?}", stats.gangs);
}

/// Collective mode splits in lockstep: every trainer runs the same number of micro-batches, a
/// gang's pieces share one round (the same position on every member's list), the other trainers
/// of that round run an empty micro-batch, and the sample counts once.
#[test]
fn collective_mode_runs_a_gangs_pieces_in_one_lockstep_round() {
    let config = StepConfig {
        communication: Communication::Collective,
        ..split_config(SplitPolicy::Auto)
    };
    config.validate().unwrap();
    let mut w = World::new(config, &[1.0; 4]);
    let samples = long_tail(60_000, 30);
    let total: u64 = samples.iter().map(|s| s.tokens).sum();
    let stats = w.step(samples).expect("finished").expect("ok");
    assert_eq!(stats.gangs.len(), 1, "{:?}", stats.gangs);
    let runs = assignments(&w.log);
    // Each trainer's list, in the order it ran.
    let mut lists: Vec<Vec<MicroBatch>> = vec![Vec::new(); 4];
    for (slot, mb, _) in &runs {
        lists[*slot as usize].push(mb.clone());
    }
    let rounds = lists[0].len();
    assert!(lists.iter().all(|l| l.len() == rounds), "lockstep counts");
    let round_of_pieces: Vec<usize> = lists
        .iter()
        .filter_map(|l| l.iter().position(|mb| !mb.pieces.is_empty()))
        .collect();
    assert_eq!(round_of_pieces.len(), stats.gangs[0] as usize);
    assert!(
        round_of_pieces.iter().all(|&r| r == round_of_pieces[0]),
        "one round"
    );
    let r = round_of_pieces[0];
    for l in &lists {
        if l[r].pieces.is_empty() {
            assert!(
                l[r].samples.is_empty() && l[r].tokens == 0,
                "an empty micro-batch"
            );
        }
    }
    assert_eq!(runs.iter().map(|(_, mb, _)| mb.tokens).sum::<u64>(), total);
    assert!((stats.loss - 1.0).abs() < 1e-12, "{}", stats.loss);
}

/// I2 for a gang: a member lost mid-step discards the attempt; the replay plans the gang anew
/// under the next epoch (the old gang's other members can never be joined again), every member
/// of it runs once, and the sample counts once.
#[test]
fn a_lost_gang_member_replays_the_whole_gang_under_a_new_epoch() {
    let mut w = World::new(split_config(SplitPolicy::Auto), &[1.0; 4]);
    let first = w.m.start(long_tail(60_000, 30), w.now);
    w.apply(first);
    // The first assignments are the gang's pieces: lose a trainer running one.
    let (slot, piece) = w
        .running
        .iter()
        .enumerate()
        .find_map(|(s, r)| {
            r.as_ref()
                .and_then(|(a, _, _)| a.micro_batch.pieces.first().cloned().map(|p| (s, p)))
        })
        .expect("a member is running its piece");
    assert_eq!(piece.epoch, 0);
    w.running[slot] = None;
    let from = w.log.len();
    let ds = w.m.on_trainer_lost(slot as u32, "killed".into(), w.now);
    assert_eq!(names(&ds), ["respawn", "discard"]);
    w.apply(ds);
    let stats = w.finish().expect("finishes").expect("replayed");
    assert_eq!(stats.replays, 1);
    let replayed: Vec<(u32, Assignment)> = assigned(&w.log[from..])
        .into_iter()
        .filter(|(_, a)| a.epoch == 1)
        .collect();
    let pieces: Vec<Piece> = replayed
        .iter()
        .flat_map(|(_, a)| a.micro_batch.pieces.clone())
        .collect();
    assert_eq!(pieces.len(), stats.gangs.iter().sum::<u32>() as usize);
    assert!(!pieces.is_empty());
    assert!(pieces.iter().all(|p| p.epoch == 1), "{pieces:?}");
    assert!((stats.loss - 1.0).abs() < 1e-12, "{}", stats.loss);
}

/// A sample over the token budget runs as a gang whose pieces fit the budget; where no gang the
/// step allows can cut it, and with splitting off, the step fails naming the sample.
#[test]
fn a_sample_over_the_budget_runs_as_a_gang_whose_pieces_fit_it() {
    let mut w = World::new(split_config(SplitPolicy::Auto), &[1.0; 4]);
    let stats = w
        .step(long_tail(200_000, 10))
        .expect("finished")
        .expect("ok");
    assert_eq!(stats.gangs, vec![4], "50,000 tokens a member");
    for (_, mb, _) in assignments(&w.log) {
        assert!(mb.tokens <= 65_536, "{}", mb.tokens);
    }
    for (config, wanted) in [
        (
            StepConfig {
                max_gang: 2,
                ..split_config(SplitPolicy::Auto)
            },
            "sample 0 has 200000 tokens",
        ),
        (split_config(SplitPolicy::Off), "200000"),
    ] {
        let mut w = World::new(config, &[1.0; 4]);
        let e = w
            .step(long_tail(200_000, 10))
            .expect("finished")
            .unwrap_err();
        assert!(e.to_string().contains(wanted), "{e}");
    }
}

/// Context parallelism in collective mode: lockstep rounds whose micro-batches hold several
/// pieces; every piece's members run it in the same round, gangs ascending in each micro-batch;
/// every sample counts once; static CP splits every sample over its fixed group.
#[test]
fn context_parallel_rounds_run_each_gang_together_and_every_sample_once() {
    for cp in [ContextParallel::Static(2), ContextParallel::Dynamic] {
        let config = StepConfig {
            communication: Communication::Collective,
            dispatch: DispatchMode::Static,
            context_parallel: cp,
            ..split_config(SplitPolicy::Off)
        };
        config.validate().unwrap();
        let mut w = World::new(config, &[1.0; 4]);
        let samples = long_tail(60_000, 30);
        let total: u64 = samples.iter().map(|s| s.tokens).sum();
        let stats = w.step(samples).expect("finished").expect("ok");
        let runs = assignments(&w.log);
        let mut lists: Vec<Vec<MicroBatch>> = vec![Vec::new(); 4];
        for (slot, mb, _) in &runs {
            lists[*slot as usize].push(mb.clone());
        }
        let rounds = lists[0].len();
        assert!(lists.iter().all(|l| l.len() == rounds), "{cp}: lockstep");
        // (gang → the round and slot of each member).
        let mut members: std::collections::BTreeMap<u32, Vec<(usize, u32, u32)>> =
            Default::default();
        for (slot, list) in lists.iter().enumerate() {
            for (r, mb) in list.iter().enumerate() {
                assert!(mb.pieces.windows(2).all(|p| p[0].gang < p[1].gang));
                for p in &mb.pieces {
                    assert_eq!(p.ranks[p.member as usize], slot as u32);
                    members
                        .entry(p.gang)
                        .or_default()
                        .push((r, p.member, p.members));
                }
            }
        }
        assert!(!members.is_empty(), "{cp}: the long sample is split");
        for (g, m) in &members {
            assert_eq!(m.len(), m[0].2 as usize, "{cp}: gang {g} {m:?}");
            assert!(
                m.iter().all(|x| x.0 == m[0].0),
                "{cp}: gang {g} in one round"
            );
        }
        if cp == ContextParallel::Static(2) {
            assert_eq!(members.len(), 31, "every sample split");
            assert!(runs.iter().all(|(_, mb, _)| mb.samples.is_empty()));
        }
        assert_eq!(runs.iter().map(|(_, mb, _)| mb.tokens).sum::<u64>(), total);
        assert!((stats.loss - 1.0).abs() < 1e-12, "{}", stats.loss);
        assert_eq!(
            stats.gangs.len(),
            members.len(),
            "{cp}: each gang counted once"
        );
    }
}

#[test]
fn context_parallel_is_a_collective_baseline_apart_from_splitting() {
    let on_demand = StepConfig {
        context_parallel: ContextParallel::Static(2),
        ..split_config(SplitPolicy::Off)
    };
    let e = on_demand.validate().unwrap_err().to_string();
    assert!(e.contains("collective-mode baseline"), "{e}");
    let both = StepConfig {
        communication: Communication::Collective,
        context_parallel: ContextParallel::Dynamic,
        ..split_config(SplitPolicy::Auto)
    };
    let e = both.validate().unwrap_err().to_string();
    assert!(e.contains("exclude each other"), "{e}");
}
