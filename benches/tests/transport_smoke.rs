//! `odc-bench transport --quick` runs as a smoke test: every backend × size has a row, every
//! number is finite and positive, the ratio is the quotient of the two bandwidths, the table and
//! its legend are printed, and the owner processes leave no shared-memory files behind. Bad input
//! is refused before anything runs.

mod common;

use std::collections::BTreeSet;

use common::{odc_bench, temp};
use serde_json::Value;

/// Names in `/dev/shm` that the benchmark's shm owners create (job `odc-bench-{pid}`).
fn bench_shm_files() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("odc-odc-bench-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn quick_transport_bench_writes_sensible_json() {
    let json = temp("transport.json");
    let before = bench_shm_files();
    let out = odc_bench(&["transport", "--quick", "--json", json.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for said in [
        "ABBA",
        "limit of local: memcpy",
        "limit of shm: memcpy",
        "limit of tcp: a raw tokio TcpStream",
        "latency us",
        "target tcp 4 KiB",
    ] {
        assert!(
            stdout.contains(said),
            "the bench states {said:?}:\n{stdout}"
        );
    }

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON parses");
    std::fs::remove_file(&json).unwrap();
    assert_eq!(
        report.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["rows"]
    );
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 9, "{report}");
    for backend in ["local", "shm", "tcp"] {
        for bytes in [4096u64, 1 << 20, 64 << 20] {
            let matching = rows
                .iter()
                .filter(|r| r["backend"] == backend && r["bytes"].as_u64() == Some(bytes))
                .count();
            assert_eq!(
                matching, 1,
                "one {backend} row of {bytes} bytes in {report}"
            );
        }
    }
    for row in rows {
        let mut keys: Vec<&str> = row
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "backend",
                "bytes",
                "gbytes_per_s",
                "latency_us",
                "limit_gbytes_per_s",
                "ratio"
            ]
        );
        let num = |key: &str| {
            let v = row[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} is not a number in {row}"));
            assert!(v.is_finite() && v > 0.0, "{key} = {v} in {row}");
            v
        };
        let (gb, limit, ratio) = (num("gbytes_per_s"), num("limit_gbytes_per_s"), num("ratio"));
        num("latency_us");
        assert!(
            (ratio - gb / limit).abs() <= 1e-9 * ratio,
            "ratio {ratio} is not {gb} / {limit}"
        );
        // One table line per row.
        let size = match row["bytes"].as_u64().unwrap() {
            4096 => "4 KiB",
            1_048_576 => "1 MiB",
            _ => "64 MiB",
        };
        let backend = row["backend"].as_str().unwrap();
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.starts_with(backend) && l.contains(&format!(" {size} ")))
                .count(),
            1,
            "{backend} {size}:\n{stdout}"
        );
    }
    let left: Vec<String> = bench_shm_files().difference(&before).cloned().collect();
    assert!(left.is_empty(), "the shm owner left {left:?} in /dev/shm");
}

#[test]
fn bad_transport_input_is_refused_before_measuring() {
    for (args, needle) in [
        (vec!["transport", "--sizes", "10"], "multiple of 4"),
        (vec!["transport", "--sizes", "512MiB"], "more than"),
        (
            vec!["transport", "--sizes", "4KiB,4096"],
            "--sizes names 4 KiB twice",
        ),
        (vec!["transport", "--backends", "rdma"], "rdma"),
        // Built without the cuda feature, or without a CUDA driver: said before anything runs.
        (vec!["transport", "--backends", "cuda"], "cuda"),
        (vec!["transport", "--cuda-sizes", "5GiB"], "more than"),
        (
            vec!["transport", "--backends", "tcp,tcp"],
            "--backends names tcp twice",
        ),
        (
            vec!["transport", "--tcp-part-bytes", "1KiB"],
            "less than 4096",
        ),
        (vec!["transport", "--rounds", "0"], "at least 1"),
        (
            vec!["transport", "--json", "/nonexistent-dir/t.json"],
            "/nonexistent-dir",
        ),
    ] {
        let out = odc_bench(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{args:?} succeeded:\n{stdout}");
        assert!(
            stderr.contains(needle),
            "{args:?}: {needle:?} not in stderr:\n{stderr}"
        );
        assert!(
            !stdout.contains("GB/s"),
            "{args:?} started measuring:\n{stdout}"
        );
    }
}

#[test]
fn owner_without_a_secret_says_so() {
    let out = odc_bench(&["transport-owner", "--backend", "tcp", "--bytes", "4096"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.starts_with("error:") && stderr.contains("ODC_SECRET"),
        "{stderr}"
    );
}
