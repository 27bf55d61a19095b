//! `examples/rl_grpo` as a user runs it, shortened: a warm-start SFT, sampled groups on two
//! worker threads, odc updates, the report lines and one scrape of its `/metrics`; a bad flag
//! refused with its name.
#![cfg(feature = "candle")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The multi-process tests' helpers: finding an example, running it under a deadline.
#[allow(dead_code)]
#[path = "multiprocess/harness.rs"]
mod harness;

/// A small model directory in Hugging Face layout with a real chat template.
#[path = "common/model_dir.rs"]
mod model_dir;

/// Scraping the example's `/metrics` over HTTP.
#[path = "common/prometheus.rs"]
mod prometheus;

#[test]
fn a_short_grpo_run_reports_rewards_groups_and_its_final_line() {
    let addr = prometheus::free_addr();
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args(["--metrics-addr", &addr.to_string()]);
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
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rl_grpo starts");
    let (tx, lines) = mpsc::channel();
    let reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    std::thread::spawn(move || {
        for line in reader.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Once the first RL step is reported, its metrics are set: one scrape while the run goes on.
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.starts_with("step   1/2")) {
        match lines.recv_timeout(Duration::from_secs(300)) {
            Ok(line) => seen.push(line),
            Err(e) => panic!("no first step within 5 minutes ({e}): {seen:?}"),
        }
    }
    let metrics = prometheus::scrape(addr);
    // Killed (failing the test) past 5 minutes (I6).
    let out = harness::wait(child, Duration::from_secs(300));
    seen.extend(lines.iter());
    let stdout = seen.join("\n");
    for (name, kind) in [
        ("odc_grpo_reward", "gauge"),
        ("odc_grpo_accuracy_ratio", "gauge"),
        ("odc_grpo_response_tokens", "gauge"),
        ("odc_grpo_response_tokens_max", "gauge"),
        ("odc_grpo_kl", "gauge"),
        ("odc_grpo_sampling_tokens_per_second", "gauge"),
        ("odc_grpo_timing_seconds", "gauge"),
        ("odc_grpo_groups_total", "counter"),
        ("odc_grpo_groups_trained_total", "counter"),
    ] {
        assert!(
            metrics.contains(&format!("# TYPE {name} {kind}\n")),
            "{name} ({kind}) in {metrics}"
        );
    }
    // 3 prompts a step: 3 groups after step 1 (6 if step 2 was quicker than the scrape).
    assert!(
        metrics.contains("\nodc_grpo_groups_total 3\n")
            || metrics.contains("\nodc_grpo_groups_total 6\n"),
        "{metrics}"
    );
    for stage in ["gen", "reward", "ref", "gather", "update_actor"] {
        assert!(
            metrics.contains(&format!("odc_grpo_timing_seconds{{stage=\"{stage}\"}} ")),
            "stage {stage} in {metrics}"
        );
    }
    assert!(
        metrics.contains("# TYPE odc_tokens_total counter"),
        "{metrics}"
    );
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
        assert!(
            line.contains("(gen ") && line.contains(", reward ") && line.contains(", ref "),
            "the step's time split by stage: {line}"
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

/// A short run's flags: no warm start, 2 RL steps of 3 prompts, 2 responses each.
const SHORT: [&str; 13] = [
    "--sft-steps",
    "0",
    "--steps",
    "2",
    "--prompts",
    "3",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
    "--eval-problems",
    "0",
    "--no-metrics",
];

/// `--reward-command`: its numbers are the rewards (every response 0.5: every group alike, none
/// trained on), and every step's figures reach the JSONL log and TensorBoard; a command that
/// fails, hangs past `--reward-timeout` or prints what is not a number stops the run before any
/// update, with an error naming it.
#[test]
fn a_reward_command_scores_the_responses_and_its_failures_stop_the_run() {
    let dir = std::env::temp_dir().join(format!("odc-grpo-reward-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (jsonl, tb) = (dir.join("log.jsonl"), dir.join("tb"));
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args(SHORT).args([
        "--reward-command",
        "while read -r line; do echo 0.5; done",
        "--log-jsonl",
        jsonl.to_str().unwrap(),
        "--tensorboard",
        tb.to_str().unwrap(),
    ]);
    let out = harness::run(command, Duration::from_secs(300));
    let stdout = harness::succeeded(&out, "GRPO with a reward command");
    for step in ["step   1/2  reward 0.500", "step   2/2  reward 0.500"] {
        let line = stdout.lines().find(|l| l.starts_with(step));
        let line = line.unwrap_or_else(|| panic!("no {step:?} in {stdout}"));
        assert!(line.contains("groups trained 0/3"), "{line}");
    }
    let records = odc::recipe::log::read_jsonl(&jsonl).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.0).collect();
    assert_eq!(
        steps,
        [0, 1, 2, 2],
        "held-out before, two steps, held-out after"
    );
    let reward = records[2].1.iter().find(|(n, _)| n == "reward").unwrap().1;
    assert_eq!(reward, 0.5);
    let files = odc::recipe::tensorboard::event_files(&tb).unwrap();
    let events = odc::recipe::tensorboard::read_events(&files[0]).unwrap();
    assert!(events
        .iter()
        .any(|e| e.step == 2 && e.scalars.contains(&("reward".to_string(), 0.5))));

    for (script, named) in [
        (
            "echo no >&2; exit 3",
            "exited with exit status: 3; stderr: no",
        ),
        ("sleep 60", "did not finish within 1s"),
        (
            "while read -r line; do echo high; done",
            "printed \"high\" for response 1",
        ),
    ] {
        let mut command = Command::new(harness::example("rl_grpo"));
        command
            .args(SHORT)
            .args(["--reward-command", script, "--reward-timeout", "1"]);
        let out = harness::run(command, Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{script}: {stdout}");
        assert!(
            stderr.contains("--reward-command") && stderr.contains(named),
            "{script}: {stderr}"
        );
        // Stopped while scoring the first step's responses: nothing was trained.
        assert!(!stdout.contains("step   1/2"), "{script}: {stdout}");
    }
}

#[test]
fn a_zero_temperature_is_refused_with_its_name() {
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args(["--temperature", "0", "--sft-steps", "0", "--no-metrics"]);
    let out = harness::run(command, Duration::from_secs(60));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--temperature"), "{stderr}");
}

/// `rl_grpo --model-dir DIR`: the directory's weights are the policy and the reference (no warm
/// start), prompts go through its chat template, responses end at its stop ids; two RL steps run
/// and report their rewards and the final line.
#[test]
fn grpo_on_a_model_directory() {
    let dir = std::env::temp_dir().join(format!("odc-grpo-model-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = dir.join("model");
    model_dir::write_model_dir(&model);
    let mut command = Command::new(harness::example("rl_grpo"));
    command.args([
        "--model-dir",
        model.to_str().unwrap(),
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-problems",
        "1",
        "--no-metrics",
    ]);
    let out = harness::run(command, Duration::from_secs(300));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("policy and reference from"), "{stdout}");
    assert!(!stdout.contains("warm start"), "{stdout}");
    assert!(stdout.contains("step   2/2"), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("final step=2 reward="), "{last}");
    std::fs::remove_dir_all(&dir).unwrap();
}
