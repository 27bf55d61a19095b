//! `examples/rl_grpo` as a user runs it, shortened: a warm-start SFT, sampled groups on two
//! worker threads, odc updates, and the report lines; a bad flag refused with its name.
#![cfg(feature = "candle")]

use std::process::Command;
use std::time::Duration;

/// The multi-process tests' helpers: finding an example, running it under a deadline.
#[allow(dead_code)]
#[path = "multiprocess/harness.rs"]
mod harness;

#[test]
fn a_short_grpo_run_reports_rewards_groups_and_its_final_line() {
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args([
        "--sft-steps",
        "2",
        "--steps",
        "2",
        "--prompts",
        "3",
        "--group-size",
        "2",
        "--max-new-tokens",
        "16",
        "--eval-problems",
        "2",
    ]);
    // Killed (failing the test) past 5 minutes (I6).
    let out = harness::run(command, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("no --init: a 2-step SFT warm start first"),
        "{stdout}"
    );
    for held_out in [
        "held-out before RL (2 problems): greedy accuracy",
        "held-out after RL (2 problems): greedy accuracy",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(held_out))
            .unwrap_or_else(|| panic!("no {held_out:?} line in {stdout}"));
        assert!(line.contains("2 samples each: reward"), "{line}");
    }
    for step in ["step   1/2", "step   2/2"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(step))
            .unwrap_or_else(|| panic!("no {step:?} line in {stdout}"));
        assert!(
            line.contains("groups trained") && line.contains("/3"),
            "{line}"
        );
    }
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("final step=2 reward="), "{last}");
    let reward: f64 = last
        .split("reward=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no reward in {last:?}"));
    assert!(
        reward.is_finite() && (0.0..=1.5).contains(&reward),
        "{last}"
    );
}

#[test]
fn a_zero_temperature_is_refused_with_its_name() {
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args(["--temperature", "0", "--sft-steps", "0"]);
    let out = harness::run(command, Duration::from_secs(60));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--temperature"), "{stderr}");
}
