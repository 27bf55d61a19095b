//! Bad input to `odc-bench ab` is refused before anything runs: exit status non-zero, one message
//! naming the line, flag or limit, each said once. Every run is killed after
//! [`common::KILL_AFTER`], so a check that would start the (minutes-long) benchmark fails instead
//! of hanging.

mod common;

use common::{odc_bench, temp};

/// Asserts `args` fail, their stderr contains every one of `needles` and states the first once,
/// and nothing was measured.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let out = odc_bench(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "{args:?} succeeded:\n{stdout}\n{stderr}"
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "{args:?}: {n:?} not in stderr:\n{stderr}"
        );
    }
    if let Some(first) = needles.first() {
        assert_eq!(
            stderr.matches(first).count(),
            1,
            "{first:?} said more than once:\n{stderr}"
        );
    }
    assert!(
        !stdout.contains("collective tok/s"),
        "{args:?} started measuring:\n{stdout}"
    );
    stderr
}

#[test]
fn lengths_above_the_maximum_are_refused_naming_the_line() {
    for (i, value) in [
        "1000000000000",
        "10000000000000000000",
        "99999999999999999999999",
        "1048577",
    ]
    .into_iter()
    .enumerate()
    {
        let path = temp(&format!("long-{i}.txt"));
        std::fs::write(&path, format!("# lengths\n1200\n{value}\n800\n")).unwrap();
        let file = path.to_str().unwrap();
        let stderr = refused(
            &["ab", "--lengths", file, "--devices", "2"],
            &["line 3", value, "1048576", file],
        );
        assert_eq!(stderr.matches(file).count(), 1, "path said once:\n{stderr}");
        assert!(!stderr.contains("token budget"), "{stderr}");
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn bad_lengths_lines_and_missing_files_are_refused_once() {
    let path = temp("negative.txt");
    std::fs::write(&path, "1200\n800\n-5\n").unwrap();
    let file = path.to_str().unwrap();
    refused(&["ab", "--lengths", file], &["line 3", "positive"]);
    let _ = std::fs::remove_file(&path);
    let missing = temp("does-not-exist.txt");
    let file = missing.to_str().unwrap();
    refused(&["ab", "--lengths", file], &[file, "No such file"]);
}

#[test]
fn token_budget_outside_its_range_is_refused() {
    refused(
        &["ab", "--token-budget", "1048577"],
        &["--token-budget", "1048576"],
    );
    refused(
        &["ab", "--token-budget", "18446744073709551615"],
        &["--token-budget", "1048576"],
    );
    // Below the longest RL sequence (16,384 tokens): refused before running, not mid-step.
    refused(
        &["ab", "--workloads", "rl", "--token-budget", "8192"],
        &["--token-budget 8192", "16384"],
    );
}

#[test]
fn devices_and_minibatch_limits_are_checked_first() {
    refused(&["ab", "--devices", "100000"], &["--devices", "4096"]);
    refused(
        &["ab", "--minibatch-per-device", "100000"],
        &["--minibatch-per-device", "65536"],
    );
    refused(
        &["ab", "--devices", "4096", "--minibatch-per-device", "65536"],
        &["MAX_SAMPLES_PER_STEP", "1048576"],
    );
    refused(
        &["ab", "--unit-elems", "100000000"],
        &["--unit-elems", "16777216"],
    );
    refused(
        &["ab", "--units", "1024", "--unit-elems", "16777216"],
        &["MAX_MODEL_ELEMS", "67108864"],
    );
    refused(
        &[
            "ab",
            "--devices",
            "4096",
            "--minibatch-per-device",
            "1",
            "--unit-elems",
            "65536",
        ],
        &["MAX_STAGED_ELEMS"],
    );
    refused(&["ab", "--steps", "10001"], &["--steps", "10000"]);
    refused(&["ab", "--reps", "1001"], &["--reps", "1000"]);
}

#[test]
fn zero_counts_are_refused_not_changed() {
    for flag in [
        "--reps",
        "--steps",
        "--units",
        "--unit-elems",
        "--devices",
        "--minibatch-per-device",
        "--token-budget",
    ] {
        refused(&["ab", flag, "0"], &["at least 1", flag]);
    }
    // One zero in a list is enough.
    refused(&["ab", "--devices", "4,0,8"], &["at least 1", "--devices"]);
}

#[test]
fn non_finite_negative_or_huge_times_are_refused() {
    for value in ["nan", "inf", "-1", "0", "1e300"] {
        refused(&["ab", "--time-scale-ms", value], &["--time-scale-ms"]);
    }
    for value in ["nan", "-inf", "-0.5", "1e300"] {
        refused(
            &["ab", "--unit-transfer-ms", value],
            &["--unit-transfer-ms"],
        );
    }
}

#[test]
fn unwritable_outputs_fail_before_the_run() {
    // Without the checks these would run the full default matrix (minutes) before failing.
    let missing = temp("no-such-dir").join("ab.json");
    let m = missing.to_str().unwrap();
    refused(&["ab", "--json", m], &[m, "does not exist"]);
    refused(&["ab", "--plot", m], &["--plot", "does not exist"]);
    refused(&["ab", "--trace", m], &["--trace", "does not exist"]);
    let dir = std::env::temp_dir();
    let d = dir.to_str().unwrap();
    refused(&["ab", "--plot", d], &["--plot", "directory"]);
}

#[test]
fn bad_cluster_shapes_of_sim_are_refused_before_it_runs() {
    for bad in ["0", "65", "eight"] {
        refused(
            &["sim", "--gpus-per-node", bad],
            &[
                "GPUs per node must be an integer from 1 to 64",
                "--gpus-per-node",
            ],
        );
    }
    refused(
        &["sim", "--links", "nvl72"],
        &["invalid value 'nvl72'", "--links"],
    );
    refused(
        &["sim", "--routing", "ring"],
        &["invalid value 'ring'", "--routing"],
    );
    refused(
        &["sim", "--relay-pushes", "--devices-per-server", "3"],
        &[
            "relayed pushes need every shard server inside a node",
            "--devices-per-server",
        ],
    );
    refused(
        &["sim", "--pull-precision", "fp8"],
        &["invalid value 'fp8'", "--pull-precision"],
    );
    // `ab` takes the same cluster, and a bytes scale of its own.
    refused(
        &["ab", "--gpus-per-node", "0"],
        &[
            "GPUs per node must be an integer from 1 to 64",
            "--gpus-per-node",
        ],
    );
    for bad in ["0", "NaN", "1e10"] {
        refused(
            &["ab", "--links", "h100", "--bytes-scale", bad],
            &[
                "the bytes scale must be a number from 1 to 1e9",
                "--bytes-scale",
            ],
        );
    }
}
