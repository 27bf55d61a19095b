//! Per-host checkpoint directories (issue 30): two ranks of `examples/sft` over `tcp`, each
//! hosting one shard server, see different directories at the same `--checkpoint-dir` path (rank
//! 1 runs in a mount namespace where that path is a bind mount of another directory: its "host's
//! own disk"). Each host's `step-<N>` holds its own server's shard file, `state.json` and a
//! manifest of what it holds, and verifies on its own; `--keep-last` prunes both hosts (the
//! other host keeps one step more); a relaunch with `--resume auto` resumes every server from its
//! own host and ends at the uninterrupted run's loss; hosts holding different newest steps (a lead
//! that died between another host's publication and its own) are refused, naming the cause.
//!
//! Tolerance: as `restart.rs` (final loss within 1e-5 relative of one process training the same
//! data uninterrupted). Skipped, with the reason printed, where a mount namespace cannot be made
//! (`unshare -Urm` refused).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;

/// `restart.rs`'s model and schedule, with a constant rate after the warm-up: the first launch's
/// schedule (8 steps) is then the relaunch's (12; `--steps` overrides the file's 20).
fn sft_config() -> String {
    crate::restart::config().replace("[model]", "min_lr_ratio = 1.0\n\n[model]")
}

/// Why a mount namespace cannot be made here, if it cannot.
fn no_mount_namespace() -> Option<String> {
    match Command::new("unshare").args(["-Urm", "true"]).output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`unshare -Urm true` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("`unshare` cannot run: {e}")),
    }
}

/// The loss of `stdout`'s last line, `final step=<steps> loss=<f> ...`.
fn final_loss(stdout: &str, steps: u64) -> f64 {
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("final step={steps} loss=")),
        "last line: {last:?}\n{stdout}"
    );
    last.split_whitespace()
        .find_map(|w| w.strip_prefix("loss="))
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {last:?}"))
}

/// The sorted file names of `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// Two ranks of `sft` training `steps` steps with a checkpoint every 4 into `ckpt`, rank 1 seeing
/// `host_b` there, with `extra` arguments; both ranks' outputs.
fn launch(
    config: &Path,
    ckpt: &Path,
    host_b: &Path,
    steps: u64,
    extra: &[&str],
) -> Vec<std::process::Output> {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let job = format!("perhost{}x{steps}", std::process::id());
    let children: Vec<_> = (0..2u32)
        .map(|rank| {
            let mut cmd = if rank == 0 {
                Command::new(example("sft"))
            } else {
                let mut cmd = Command::new("unshare");
                cmd.args([
                    "-Urm",
                    "sh",
                    "-c",
                    r#"mount --bind "$1" "$2" && shift 2 && exec "$@""#,
                    "sh",
                ])
                .arg(host_b)
                .arg(ckpt)
                .arg(example("sft"));
                cmd
            };
            rank_env(
                &mut cmd,
                rank,
                2,
                &coordinator,
                "per-host-test-secret-0123",
                &job,
                "tcp",
            );
            cmd.arg("--config")
                .arg(config)
                .args(["--steps", &steps.to_string(), "--checkpoint-every", "4"])
                .arg("--checkpoint-dir")
                .arg(ckpt);
            cmd.args(extra);
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().expect("a rank starts")
        })
        .collect();
    children
        .into_iter()
        .map(|c| wait(c, Duration::from_secs(120)))
        .collect()
}

/// [`launch`], which must succeed on both ranks; rank 0's stdout.
fn two_hosts(config: &Path, ckpt: &Path, host_b: &Path, steps: u64, extra: &[&str]) -> String {
    let outs = launch(config, ckpt, host_b, steps, extra);
    for (rank, out) in outs.iter().enumerate() {
        succeeded(out, &format!("rank {rank} of {steps} steps"));
    }
    String::from_utf8_lossy(&outs[0].stdout).into_owned()
}

/// Rank 0's stdout resumed from `step` of `ckpt` and ended within 1e-5 of `want`; the relative
/// difference.
fn resumed_like(stdout: &str, ckpt: &Path, step: u64, want: f64) -> f64 {
    let from = format!(
        "resuming from {} at step {step}",
        ckpt.join(format!("step-{step}")).display()
    );
    assert!(stdout.contains(&from), "{from}:\n{stdout}");
    let got = final_loss(stdout, 12);
    let relative = ((got - want) / want).abs();
    assert!(
        relative <= 1e-5,
        "final loss {got} after resuming on two hosts at step {step} vs {want} uninterrupted: \
         {relative:e}"
    );
    relative
}

#[test]
fn per_host_checkpoint_directories_resume_each_server_from_its_own_host() {
    if let Some(why) = no_mount_namespace() {
        eprintln!("skipped: per-host directories are emulated with a mount namespace: {why}");
        return;
    }
    let started = Instant::now();
    let dir = temp("per-host");
    let (ckpt, host_b) = (dir.join("ckpt"), dir.join("host-b"));
    std::fs::create_dir_all(&ckpt).expect("host A's directory");
    std::fs::create_dir_all(&host_b).expect("host B's directory");
    let config = dir.join("sft.toml");
    std::fs::write(&config, sft_config()).expect("the config file");

    // The uninterrupted run: one process, 2 trainers and 2 servers, 12 steps.
    let mut cmd = Command::new(example("sft"));
    cmd.arg("--config")
        .arg(&config)
        .args(["--steps", "12", "--trainers", "2", "--servers", "2"]);
    let want = final_loss(
        &succeeded(&run(cmd, Duration::from_secs(120)), "the uninterrupted run"),
        12,
    );

    two_hosts(&config, &ckpt, &host_b, 8, &["--keep-last", "1"]);
    // `--keep-last 1` pruned the lead's host to step 8; host B, which publishes before the lead,
    // keeps one more (step 4: the newest step every host holds until the lead's step appears).
    assert_eq!(names(&ckpt), ["step-8"], "host A");
    assert_eq!(names(&host_b), ["step-4", "step-8"], "host B");
    // Each host holds its own server's file, the state and its own manifest, and verifies alone.
    let (a, b) = (ckpt.join("step-8"), host_b.join("step-8"));
    assert_eq!(
        names(&a),
        ["manifest.json", "shard-00000.safetensors", "state.json"],
        "host A"
    );
    assert_eq!(
        names(&b),
        ["manifest.json", "shard-00001.safetensors", "state.json"],
        "host B"
    );
    odc::checkpoint::verify(&a).expect("host A's step verifies");
    odc::checkpoint::verify(&b).expect("host B's step verifies");
    assert_eq!(
        std::fs::read(a.join("state.json")).expect("A's state"),
        std::fs::read(b.join("state.json")).expect("B's state"),
        "one state, every server's ranges, on both hosts"
    );

    // Every server resumes from its own host.
    let stdout = two_hosts(&config, &ckpt, &host_b, 12, &["--resume", "auto"]);
    let relative = resumed_like(&stdout, &ckpt, 8, want);

    // A lead that died after host B published step 12 and before its own: the lead's newest
    // step is 8, host B's 12. The relaunch refuses, naming the cause; deleting host B's lone
    // step, as it says, resumes both from step 8.
    std::fs::remove_dir_all(ckpt.join("step-12")).expect("the lead's step 12");
    let outs = launch(&config, &ckpt, &host_b, 12, &["--resume", "auto"]);
    let said: String = outs
        .iter()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .collect();
    assert!(
        outs.iter().any(|o| !o.status.success()),
        "a relaunch from different steps must not succeed: {said}"
    );
    assert!(
        said.contains("resume from the same checkpoint step"),
        "{said}"
    );
    std::fs::remove_dir_all(host_b.join("step-12")).expect("host B's lone step 12");
    let stdout = two_hosts(&config, &ckpt, &host_b, 12, &["--resume", "auto"]);
    resumed_like(&stdout, &ckpt, 8, want);

    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "per-host: resumed at step 8 of 12 on two hosts; final loss within {relative:e} of \
         {want} uninterrupted; a relaunch from different steps refused; {:.1} s in all",
        started.elapsed().as_secs_f64()
    );
}
