//! `odc-bench ab --quick --devices 4` runs as a smoke test: its JSON parses with sensible values,
//! and it writes the plot and the trace. Bad workload files are refused naming the line.

use std::path::PathBuf;
use std::process::Command;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("odc-smoke-{}-{name}", std::process::id()))
}

fn odc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_odc-bench"))
        .args(args)
        .output()
        .expect("run odc-bench")
}

#[test]
fn quick_ab_bench_writes_sensible_json_plot_and_trace() {
    let (json, plot, trace) = (temp("ab.json"), temp("ab.svg"), temp("trace.json"));
    let out = odc(&[
        "ab",
        "--quick",
        "--devices",
        "4",
        "--steps",
        "2",
        "--time-scale-ms",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("time scale"),
        "the bench states its time scale"
    );

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    let workloads: Vec<&str> = rows
        .iter()
        .map(|r| r["workload"].as_str().unwrap())
        .collect();
    for w in ["longalign", "rl", "balanced", "longalign+straggler"] {
        assert!(workloads.contains(&w), "{w} row in {workloads:?}");
    }
    for r in rows {
        assert_eq!(r["devices"], 4);
        for key in ["collective_utilization", "ondemand_utilization"] {
            let u = r[key].as_f64().unwrap();
            assert!(u > 0.0 && u <= 1.0, "{key} = {u} in {r}");
        }
        for key in [
            "collective_tokens_per_s",
            "ondemand_tokens_per_s",
            "bound_tokens_per_s",
        ] {
            assert!(r[key].as_f64().unwrap() > 0.0, "{key} in {r}");
        }
        let speedup = r["speedup"].as_f64().unwrap();
        let ratio = r["ondemand_tokens_per_s"].as_f64().unwrap()
            / r["collective_tokens_per_s"].as_f64().unwrap();
        assert!(
            (speedup - ratio).abs() < 1e-9 * ratio,
            "speedup is the ratio of tokens/s"
        );
        // Nothing beats perfect balance (small slack for timer noise).
        let bound = r["bound_tokens_per_s"].as_f64().unwrap();
        assert!(
            r["ondemand_tokens_per_s"].as_f64().unwrap() <= bound * 1.05,
            "{r}"
        );
    }

    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
    let timeline: serde_json::Value =
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
    for p in [json, plot, trace] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn bad_lengths_file_is_refused_naming_the_line() {
    let path = temp("lengths.txt");
    std::fs::write(&path, "1200\n800\n-5\n").unwrap();
    let out = odc(&["ab", "--lengths", path.to_str().unwrap(), "--devices", "2"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 3"), "{stderr}");
    let _ = std::fs::remove_file(path);
}
