//! `examples/rl_grpo` across processes: under `odc launch --nprocs 2 --transport shm` each rank
//! samples its share of every step's groups and of the held-out problems, and `Job::all_gather`
//! gives every rank all of them before rank 0 steps. A response's RNG depends on its problem
//! only, so every reward, accuracy, response length, KL and group count printed equals the
//! one-process run's (two trainers, two servers, sampling on two threads); the losses equal it
//! within the multi-process tolerance (I3). The policy starts from a short SFT of the reference
//! model, so some groups' rewards differ and are trained on (a random model's all score 0).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::harness::{example, odc, run, succeeded, temp};

/// A step line without its timings (`sampling … s`, `update … s (… micro-batches)`) and loss, and
/// the loss (`None`: no update).
fn step_line(line: &str) -> (String, Option<f64>) {
    let kept = line.split("  sampling ").next().unwrap_or(line).to_string();
    let loss = line
        .split("  loss ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|loss| {
            loss.parse()
                .unwrap_or_else(|_| panic!("a loss in {line:?}"))
        });
    (kept, loss)
}

/// The report lines that must match: steps, held-out scores and the final line.
fn report(stdout: &str) -> Vec<(String, Option<f64>)> {
    stdout
        .lines()
        .filter(|l| {
            l.starts_with("step ") || l.starts_with("held-out ") || l.starts_with("final step=")
        })
        .map(step_line)
        .collect()
}

#[test]
fn grpo_samples_a_share_on_every_rank_and_matches_one_process() {
    let dir = temp("grpo");
    let checkpoints = dir.join("sft");
    let mut sft = Command::new(example("sft"));
    // 60 steps at twice the default learning rate: enough for some groups to score apart within
    // 160 new tokens (as many as 120 default steps and 200 tokens; about half of CI's time here).
    sft.args([
        "--steps",
        "60",
        "--lr",
        "6e-3",
        "--checkpoint-every",
        "60",
        "--eval-problems",
        "0",
    ])
    .args(["--no-metrics", "--checkpoint-dir"])
    .arg(&checkpoints);
    succeeded(&run(sft, Duration::from_secs(400)), "the warm-start SFT");
    let init = checkpoints.join("step-60");
    let args = |init: &Path| -> Vec<String> {
        let mut args = vec!["--init".to_string(), init.display().to_string()];
        args.extend(
            [
                "--steps",
                "3",
                "--prompts",
                "8",
                "--group-size",
                "4",
                "--max-new-tokens",
                "160",
                "--eval-problems",
                "4",
                "--no-metrics",
            ]
            .map(String::from),
        );
        args
    };

    let mut single = Command::new(example("rl_grpo"));
    single
        .args(args(&init))
        .args(["--trainers", "2", "--servers", "2"]);
    let one = succeeded(&run(single, Duration::from_secs(300)), "one process");

    let mut launch = odc();
    launch
        .args(["launch", "--nprocs", "2", "--transport", "shm"])
        .args(["--timeout-secs", "240", "--"])
        .arg(example("rl_grpo"))
        .args(args(&init));
    let two = succeeded(&run(launch, Duration::from_secs(300)), "two processes");

    let (want, got) = (report(&one), report(&two));
    assert_eq!(want.len(), 3 + 2 + 1, "{one}");
    assert_eq!(got.len(), want.len(), "{two}");
    for ((want_line, want_loss), (got_line, got_loss)) in want.iter().zip(&got) {
        assert_eq!(got_line, want_line, "\none process:\n{one}\ntwo:\n{two}");
        match (want_loss, got_loss) {
            (Some(w), Some(g)) => assert!(
                (w - g).abs() <= 2e-4,
                "loss {g} across processes vs {w}: {got_line}"
            ),
            (None, None) => {}
            _ => panic!("an update in one run only: {want_line}"),
        }
    }
    assert!(
        want.iter().any(|(_, loss)| loss.is_some()),
        "no step trained a group (the warm start taught nothing?):\n{one}"
    );

    // RL checkpoints: the one-process run again, checkpointing after every step, SIGKILLed during
    // step 3, then resumed with `--resume auto`: it continues the same prompts and draws from
    // the newest complete checkpoint and ends as the uninterrupted run did.
    let checkpoints = dir.join("rl");
    let resumable = |resume: bool| {
        let mut command = Command::new(example("rl_grpo"));
        command
            .args(args(&init))
            .args([
                "--trainers",
                "2",
                "--servers",
                "2",
                "--checkpoint-every",
                "1",
            ])
            .arg("--checkpoint-dir")
            .arg(&checkpoints);
        if resume {
            command.args(["--resume", "auto"]);
        }
        command
    };
    let mut first = resumable(false)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("rl_grpo starts");
    let pid = first.id() as i32;
    // I6: the run is killed (and the read below ends) past its deadline whatever happens; the
    // watchdog stands down (its channel closed) once the run has been reaped.
    let (reaped, deadline) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let late = deadline.recv_timeout(Duration::from_secs(300));
        if matches!(late, Err(std::sync::mpsc::RecvTimeoutError::Timeout)) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let stdout = first.stdout.take().expect("piped stdout");
    let (seen, _) = super::harness::read_until(stdout, "step   2/3");
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = first.wait();
    drop(reaped);
    let _ = watchdog.join();
    let resumed = succeeded(
        &run(resumable(true), Duration::from_secs(300)),
        "the resumed run",
    );
    assert!(
        resumed.contains("resuming from "),
        "no checkpoint was resumed from (written before the kill: {seen:?}):\n{resumed}"
    );
    let got = report(&resumed);
    assert!(
        got.iter().any(|(line, _)| line.starts_with("step   3/3")),
        "{resumed}"
    );
    for (got_line, got_loss) in &got {
        let key: String = got_line.chars().take(12).collect();
        let (want_line, want_loss) = want
            .iter()
            .find(|(line, _)| line.starts_with(&key))
            .unwrap_or_else(|| panic!("{got_line:?} is not in the uninterrupted run:\n{one}"));
        assert_eq!(
            got_line, want_line,
            "\nresumed:\n{resumed}\nuninterrupted:\n{one}"
        );
        match (want_loss, got_loss) {
            (Some(w), Some(g)) => assert!((w - g).abs() <= 2e-4, "loss {g} resumed vs {w}"),
            (None, None) => {}
            _ => panic!("an update in one run only: {want_line}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
