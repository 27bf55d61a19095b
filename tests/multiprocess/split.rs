//! (g) Sequence splitting across processes: `examples/sft --split auto` under `odc launch
//! --nprocs 2 --transport tcp` (one trainer and one server per process), on problems of which
//! some are long: the planner splits long samples over both trainers, whose keys and values
//! cross the TCP transport into each other's inbox, and the run ends at the single-process
//! unsplit run's final loss.
//!
//! Tolerance: the final loss within `1e-5` relative (the order of fp32 sums differs, as in the
//! restart test). That splitting happened is read from rank 0's step lines (`split [2]`).

use std::process::Command;
use std::time::Duration;

use crate::harness::*;
use crate::sft_toml::sft_toml;

/// Four steps of minibatches that the long problems fit whole (4,096 tokens).
fn config() -> String {
    sft_toml(
        r#"
steps = 4
batch_size = 4
token_budget = 4096
eval_every = 0
eval_problems = 0
no_metrics = true
lr = 0.01
warmup_steps = 1
"#,
        4096,
    )
}

/// Sixteen problems; every fourth one's question is ~2,400 bytes (byte tokens) long.
fn problems() -> String {
    (0..16)
        .map(|i| {
            let filler = if i % 4 == 0 {
                " Think about the apples in the basket, one by one.".repeat(48)
            } else {
                String::new()
            };
            format!(
                "{{\"question\": \"Tom has {i} apples and buys 3.{filler} How many?\", \
                 \"answer\": \"{i} + 3 = {}\\n#### {}\"}}\n",
                i + 3,
                i + 3
            )
        })
        .collect()
}

#[test]
fn two_processes_over_tcp_split_long_samples_and_train_as_one_unsplit_process() {
    let dir = temp("split");
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    std::fs::write(dir.join("sft.toml"), config()).expect("the config file");
    std::fs::write(dir.join("data.jsonl"), problems()).expect("the data file");
    let sft = |cmd: &mut Command| {
        cmd.arg("--config")
            .arg(dir.join("sft.toml"))
            .arg("--data")
            .arg(dir.join("data.jsonl"));
    };

    // One process, nothing split.
    let mut one = Command::new(example("sft"));
    sft(&mut one);
    one.args(["--trainers", "2", "--servers", "2", "--split", "off"]);
    let stdout = succeeded(&run(one, Duration::from_secs(120)), "one process");
    let want = final_loss_of(&stdout, 4);

    // Two processes over tcp, splitting.
    let mut two = odc();
    two.args([
        "launch",
        "--nprocs",
        "2",
        "--transport",
        "tcp",
        "--timeout-secs",
        "150",
        "--",
    ])
    .arg(example("sft"));
    sft(&mut two);
    two.args(["--split", "auto"]);
    let stdout = succeeded(&run(two, Duration::from_secs(180)), "two processes");
    let got = final_loss_of(&stdout, 4);
    assert!(
        ((got - want) / want).abs() <= 1e-5,
        "split over two processes: loss {got} vs one unsplit process {want}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("step ") && l.ends_with("split [2]")),
        "no step line names a gang: nothing was split\n{stdout}"
    );
}

/// The issue's failure test: three processes over tcp (servers on ranks 0 and 1, a trainer on
/// each of 0, 1 and 2), every minibatch's long problem split over a gang; rank 2 — a trainer and
/// nothing else — is killed mid-run. Its gang's micro-batch is replayed with the trainers left
/// (`--on-trainer-failure drop`: the other members' waits end at the discard, not at a deadline),
/// and the run ends at the failure-free run's final loss (`1e-5` relative).
#[test]
fn a_killed_gang_member_process_is_replayed_and_training_is_unchanged() {
    let dir = temp("split-kill");
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let config = config().replace("steps = 4", "steps = 24");
    std::fs::write(dir.join("sft.toml"), config).expect("the config file");
    // Every problem of a minibatch of 4: one long (~2,400 tokens), three short.
    std::fs::write(dir.join("data.jsonl"), problems().repeat(8)).expect("the data file");
    let common: Vec<String> = [
        "--config",
        &dir.join("sft.toml").display().to_string(),
        "--data",
        &dir.join("data.jsonl").display().to_string(),
        "--split",
        "auto",
        "--on-trainer-failure",
        "drop",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();

    // The failure-free run: one process, 3 trainers and 2 servers.
    let mut one = Command::new(example("sft"));
    one.args(&common)
        .args(["--trainers", "3", "--servers", "2"]);
    let stdout = succeeded(&run(one, Duration::from_secs(150)), "the failure-free run");
    let want = final_loss_of(&stdout, 24);

    let mut args = common.clone();
    args.extend(
        ["--servers-on", "0,1", "--trainers-on", "0,1,2"]
            .iter()
            .map(|s| s.to_string()),
    );
    let secret = "s3cret-gang-kill-0123456789abcdef";
    let ranks = Ranks::start_program(&example("sft"), 3, "tcp", &[secret; 3], &args);
    // Step 2 or 3 is computing 60 ms after step 1's line: kill the trainer-only rank inside it.
    let (_, results) = ranks.kill_during(
        "step    1/",
        Duration::from_millis(60),
        2,
        Duration::from_secs(150),
    );
    let (status0, stdout0, stderr0) = &results[0];
    assert_eq!(*status0, Some(0), "rank 0: {stdout0}\n{stderr0}");
    assert_eq!(results[1].0, Some(0), "rank 1: {}", results[1].2);
    assert_eq!(results[2].0, None, "rank 2 was killed by a signal");
    assert!(
        stderr0.contains("trainer 2 failed"),
        "rank 0 logs the lost trainer: {stderr0}"
    );
    assert!(
        stdout0
            .lines()
            .any(|l| l.starts_with("step ") && l.contains("split [")),
        "the run split samples: {stdout0}"
    );
    let got = final_loss_of(stdout0, 24);
    eprintln!(
        "a killed gang member: rank 0 logged {:?}; steps {:?}; loss {got} vs {want}",
        stderr0
            .lines()
            .filter(|l| l.contains("trainer 2") || l.contains("gang"))
            .collect::<Vec<_>>(),
        stdout0
            .lines()
            .filter(|l| l.starts_with("step "))
            .collect::<Vec<_>>()
    );
    assert!(
        ((got - want) / want).abs() <= 1e-5,
        "after a killed gang member: loss {got} vs the failure-free run's {want}"
    );
}

fn final_loss_of(stdout: &str, steps: u32) -> f64 {
    let prefix = format!("final step={steps} ");
    let last = stdout
        .lines()
        .rfind(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no final line: {stdout}"));
    last.split_whitespace()
        .find_map(|w| w.strip_prefix("loss="))
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {last:?}"))
}
