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

const CONFIG: &str = r#"
steps = 4
batch_size = 4
token_budget = 4096
eval_every = 0
eval_problems = 0
no_metrics = true
lr = 0.01
warmup_steps = 1

[model]
vocab_size = 259
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
max_seq_len = 4096
rope_theta = 10000.0
rms_eps = 1e-5
init_std = 0.05
seed = 3
"#;

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

fn final_loss(stdout: &str) -> f64 {
    let last = stdout
        .lines()
        .rfind(|l| l.starts_with("final step=4 "))
        .unwrap_or_else(|| panic!("no final line: {stdout}"));
    last.split_whitespace()
        .find_map(|w| w.strip_prefix("loss="))
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {last:?}"))
}

#[test]
fn two_processes_over_tcp_split_long_samples_and_train_as_one_unsplit_process() {
    let dir = temp("split");
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    std::fs::write(dir.join("sft.toml"), CONFIG).expect("the config file");
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
    let out = run(one, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = final_loss(&stdout);

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
    let out = run(two, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = final_loss(&stdout);
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
