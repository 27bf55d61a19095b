//! `odc-bench ab --quick --devices 4` (2 steps, 1 repetition, 1 ms per cost unit) runs as a smoke
//! test: its JSON parses with sensible values that satisfy the invariants a measurement cannot
//! break (bounds ordered, speedup the ratio of throughputs, controls matching their rows), and it
//! writes the plot and the trace.

mod common;

use common::{odc_bench, temp};
use serde_json::Value;

/// Runs `odc-bench` with `args`, asserts it succeeded (printing both streams if not), and returns
/// its stdout.
fn odc_bench_ok(args: &[&str]) -> String {
    let out = odc_bench(args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn f64_of(row: &Value, key: &str) -> f64 {
    row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {row}"))
}

#[test]
fn quick_ab_bench_writes_sensible_json_plot_and_trace() {
    let (json, plot, trace) = (temp("ab.json"), temp("ab.svg"), temp("trace.json"));
    let stdout = odc_bench_ok(&[
        "ab",
        "--quick",
        "--devices",
        "4",
        "--steps",
        "2",
        "--reps",
        "1",
        "--time-scale-ms",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    for said in [
        "time scale",
        "emulation floor",
        "median",
        "p90",
        "1.00x when the comparison is fair",
        "od/achievable",
    ] {
        assert!(
            stdout.contains(said),
            "the bench states {said:?}:\n{stdout}"
        );
    }

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    // 3 workloads × 2 dispatch modes, the straggler scenario's 4, and the controls of its two
    // rebalancing dispatches.
    assert_eq!(rows.len(), 3 * 2 + 4 + 2, "{report}");
    let table_rows = stdout
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("4"))
        .count();
    assert_eq!(
        table_rows,
        rows.len(),
        "one table line per JSON row:\n{stdout}"
    );
    let workloads: Vec<&str> = rows
        .iter()
        .map(|r| r["workload"].as_str().unwrap())
        .collect();
    for w in ["longalign", "rl", "balanced", "longalign+straggler"] {
        assert!(workloads.contains(&w), "{w} row in {workloads:?}");
    }
    // Controls run first.
    let first_other = workloads.iter().position(|w| *w != "balanced").unwrap();
    assert!(
        workloads[first_other..].iter().all(|w| *w != "balanced"),
        "{workloads:?}"
    );

    for r in rows {
        assert_eq!(r["devices"], 4);
        for key in ["collective_utilization", "ondemand_utilization"] {
            let u = f64_of(r, key);
            assert!(u > 0.0 && u <= 1.0, "{key} = {u} in {r}");
        }
        for key in [
            "collective_tokens_per_s",
            "ondemand_tokens_per_s",
            "speedup",
            "bound_tokens_per_s",
            "achievable_bound_tokens_per_s",
            "ondemand_over_achievable",
            "control_speedup",
        ] {
            let v = f64_of(r, key);
            assert!(v.is_finite() && v > 0.0, "{key} = {v} in {r}");
        }
        let (coll, od) = (
            f64_of(r, "collective_tokens_per_s"),
            f64_of(r, "ondemand_tokens_per_s"),
        );
        let speedup = f64_of(r, "speedup");
        assert!(
            (speedup - od / coll).abs() < 1e-9 * speedup,
            "speedup is the ratio: {r}"
        );
        // Nothing beats the achievable bound (small slack for timer noise), which is at most the
        // perfect-balance bound.
        let (bound, achievable) = (
            f64_of(r, "bound_tokens_per_s"),
            f64_of(r, "achievable_bound_tokens_per_s"),
        );
        assert!(od <= achievable * 1.05, "{r}");
        assert!(achievable <= bound * (1.0 + 1e-9), "{r}");
        let over = f64_of(r, "ondemand_over_achievable");
        assert!((over - od / achievable).abs() < 1e-9 * over, "{r}");
        // The control of a row is the balanced row at the same devices, minibatch and dispatch.
        let control = rows
            .iter()
            .find(|c| {
                c["workload"] == "balanced"
                    && c["devices"] == r["devices"]
                    && c["minibatch_per_device"] == r["minibatch_per_device"]
                    && c["dispatch"] == r["dispatch"]
            })
            .unwrap_or_else(|| panic!("no control for {r}"));
        assert_eq!(r["control_speedup"], control["speedup"], "{r}");
        let warning = &r["emulation_warning"];
        assert!(
            warning.is_null()
                || warning
                    .as_str()
                    .is_some_and(|w| w.contains("--time-scale-ms")),
            "{r}"
        );
    }

    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
    let timeline: Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).expect("trace parses");
    let events = timeline["traceEvents"].as_array().unwrap();
    let names: std::collections::HashSet<&str> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for n in ["compute", "pull wait", "push wait", "barrier wait"] {
        assert!(names.contains(n), "{n} spans in the trace: {names:?}");
    }
    let mut collective = trace.clone().into_os_string();
    collective.push(".collective.json");
    let collective = std::path::PathBuf::from(collective);
    let _: Value = serde_json::from_str(&std::fs::read_to_string(&collective).unwrap())
        .expect("collective trace parses");
    for p in [json, plot, trace, collective] {
        let _ = std::fs::remove_file(p);
    }
}

/// `--clock virtual` is deterministic: the same seed gives byte-identical JSON, the emulation
/// floor is not measured (it does not apply), and no row carries a warning.
#[test]
fn virtual_clock_ab_bench_repeats_byte_for_byte() {
    let run = |name: &str| {
        let json = temp(name);
        let stdout = odc_bench_ok(&[
            "ab",
            "--quick",
            "--devices",
            "4",
            "--steps",
            "2",
            "--reps",
            "1",
            "--unit-transfer-ms",
            "0.5",
            "--clock",
            "virtual",
            "--json",
            json.to_str().unwrap(),
        ]);
        let bytes = std::fs::read(&json).expect("JSON written");
        let _ = std::fs::remove_file(&json);
        (bytes, stdout)
    };
    let (first, stdout) = run("virtual-a.json");
    let (second, _) = run("virtual-b.json");
    assert!(!first.is_empty());
    assert_eq!(first, second, "same seed, same bytes");
    assert!(
        stdout.contains("does not apply in virtual time"),
        "{stdout}"
    );
    assert!(!stdout.contains("! emulation"), "{stdout}");
    let report: Value = serde_json::from_slice(&first).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    assert!(!rows.is_empty());
    assert!(rows.iter().all(|r| r["emulation_warning"].is_null()));
}

/// `odc-bench sim`: the runtime rows on the virtual clock with their balanced control at 1.00,
/// and the long-sequence table in PATH.split.json, one row per workload and device count, every
/// figure finite and no split plan slower than the unsplit one.
#[test]
fn sim_projects_runtime_rows_and_the_split_table() {
    let (json, plot) = (temp("sim.json"), temp("sim.svg"));
    let stdout = odc_bench_ok(&[
        "sim",
        "--devices",
        "4,8",
        "--workloads",
        "longalign,rl",
        "--steps",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let report: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("JSON written")).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    // longalign, rl and the balanced control at 4 and 8 devices.
    assert_eq!(rows.len(), 6, "{stdout}");
    for row in rows {
        let control = f64_of(row, "control_speedup");
        assert!((control - 1.0).abs() <= 0.01, "control {control}: {row}");
        assert!(f64_of(row, "speedup") >= 0.99, "{row}");
    }
    let split: Value = serde_json::from_slice(
        &std::fs::read(format!("{}.split.json", json.display())).expect("split JSON written"),
    )
    .expect("split JSON parses");
    let split_rows = split["rows"].as_array().expect("split rows");
    assert_eq!(split_rows.len(), 4, "{stdout}");
    for row in split_rows {
        let (perfect, unsplit, with) = (
            f64_of(row, "perfect_s"),
            f64_of(row, "unsplit_s"),
            f64_of(row, "split_s"),
        );
        assert!(
            perfect > 0.0 && perfect <= with + 1e-9 && with <= unsplit + 1e-9,
            "{row}"
        );
    }
    assert!(stdout.contains("Long sequences"), "{stdout}");
    // The joined table: one line per runtime row, the control without model columns.
    let joined: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("| workload | devices | collective | on-demand/collective"))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(joined.len(), 2 + rows.len(), "{stdout}");
    assert!(
        joined
            .iter()
            .any(|l| l.starts_with("| balanced | 8 | fsdp |") && l.ends_with("| – | – | – |")),
        "{stdout}"
    );
    // sim's own plot: speedup against devices, every workload named.
    let svg = std::fs::read_to_string(&plot).expect("SVG written");
    assert!(svg.starts_with("<svg"), "{svg}");
    for name in [
        "longalign",
        "rl",
        "balanced (control)",
        "devices",
        "speedup (×)",
    ] {
        assert!(svg.contains(name), "{name} not in the plot");
    }
    assert!(
        !svg.contains("workload/devices"),
        "ab's per-row chart instead of sim's"
    );
    let split = std::path::PathBuf::from(format!("{}.split.json", json.display()));
    for p in [json, split, plot] {
        let _ = std::fs::remove_file(p);
    }
}

/// `odc-bench sim --relay-pushes`: the on-demand side relays its pushes through the node (one
/// shard server per node by default), says so, and its balanced control stays near 1.00.
#[test]
fn sim_relays_pushes_through_the_node() {
    let json = temp("sim-relay.json");
    let stdout = odc_bench_ok(&[
        "sim",
        "--devices",
        "16",
        "--workloads",
        "rl",
        "--steps",
        "1",
        "--relay-pushes",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(stdout.contains("relayed through the node"), "{stdout}");
    assert!(stdout.contains("8 devices per shard server"), "{stdout}");
    let report: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("JSON written")).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{stdout}");
    for row in rows {
        let control = f64_of(row, "control_speedup");
        assert!((control - 1.0).abs() <= 0.02, "control {control}: {row}");
        assert!(f64_of(row, "ondemand_over_achievable") > 0.8, "{row}");
    }
}
