//! `examples/sft --model-dir` across processes: under `odc launch --nprocs 2 --transport shm`
//! every rank opens the same Hugging Face directory and each shard server converts only its own
//! slice of every unit from the mapped files; the trained model (exported by rank 0) equals the
//! one-process run's within the multi-process tolerance (I3), and so does the last loss.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::harness::{example, odc, run, succeeded, temp};

#[path = "../common/model_dir.rs"]
mod fixture;

/// `final step=<n> loss=<f> …`'s loss.
fn final_loss(stdout: &str) -> f64 {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("final step="))
        .filter_map(|rest| rest.split(" loss=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .find_map(|loss| loss.parse().ok())
        .unwrap_or_else(|| panic!("no final line: {stdout}"))
}

fn exported(dir: &Path) -> Vec<Vec<f32>> {
    odc::model::hf::HfCheckpoint::open(dir)
        .and_then(|c| c.all_unit_values())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

#[test]
fn a_model_directory_trains_across_processes_as_in_one() {
    let dir = temp("model-dir");
    let model = dir.join("model");
    fixture::write_model_dir(&model);
    let data = dir.join("chat.jsonl");
    fixture::write_chat_jsonl(&data, odc::text::ArithTask::train(3).problems(0..24), None);
    let args = |out: &Path| -> Vec<String> {
        [
            "--model-dir",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--token-budget",
            "1024",
            "--no-metrics",
            "--export-dtype",
            "f32",
            "--export-hf",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    let one = dir.join("one");
    let mut single = Command::new(example("sft"));
    single
        .args(args(&one))
        .args(["--trainers", "2", "--servers", "2"]);
    let stdout = succeeded(&run(single, Duration::from_secs(300)), "one process");

    let two = dir.join("two");
    let mut launch = odc();
    launch
        .args([
            "launch",
            "--nprocs",
            "2",
            "--transport",
            "shm",
            "--timeout-secs",
            "240",
        ])
        .arg("--")
        .arg(example("sft"))
        .args(args(&two));
    let launched = run(launch, Duration::from_secs(300));
    let launched_stdout = String::from_utf8_lossy(&launched.stdout).into_owned();
    assert!(
        launched.status.success(),
        "{launched_stdout}\n{}",
        String::from_utf8_lossy(&launched.stderr)
    );

    let (want, got) = (final_loss(&stdout), final_loss(&launched_stdout));
    assert!(
        ((got - want) / want).abs() <= 1e-6,
        "loss across processes {got} vs one process {want}"
    );
    let (a, b) = (exported(&one), exported(&two));
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(&b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0f32, f32::max);
    assert!(diff <= 1e-5, "parameters across processes differ by {diff}");
    let start = exported(&model);
    assert!(
        start
            .iter()
            .zip(&a)
            .any(|(x, y)| x.iter().zip(y).any(|(p, q)| (p - q).abs() > 1e-4)),
        "training moved nothing"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
