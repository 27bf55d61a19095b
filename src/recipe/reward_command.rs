//! A user's reward as a command ([`RewardCommand`], GRPO's `--reward-command`): any program
//! that reads responses as JSON and prints their rewards, in whatever language the user scores
//! in, beside the built-in GSM8K reward.
//!
//! The protocol, one run of the command per batch of responses (`sh -c COMMAND`):
//! - stdin: one JSON object per response and line, `{"prompt": …, "completion": …,
//!   "answer": …}` (the prompt as the model saw it, the sampled completion, and the problem's
//!   reference answer), then end of file;
//! - stdout: one number per response and line, in the same order (JSON numbers: `1`, `0.25`,
//!   `-3e-2`); then the command exits 0. Blank lines are skipped.
//!
//! Guarantees: a run that exits non-zero, outlives its deadline (the command and everything it
//! started are killed, its process group), prints a line that is not a finite number, or prints
//! more or fewer numbers than it was given responses, is an error naming the command and what
//! it did, with the end of its stderr. No reward of that batch is returned, so nothing is
//! trained on it.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{RecipeError, Result};

/// One response to score.
#[derive(Debug, Clone, Serialize)]
pub struct RewardInput<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub answer: &'a str,
}

/// A user's reward command with its deadline per run (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct RewardCommand {
    pub command: String,
    pub timeout: Duration,
}

impl RewardCommand {
    /// The rewards of `inputs`, in order, from one run of the command.
    pub fn score(&self, inputs: &[RewardInput<'_>]) -> Result<Vec<f64>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let mut stdin = String::new();
        for input in inputs {
            let line = serde_json::to_string(input).map_err(|e| self.error(&e.to_string()))?;
            stdin += &line;
            stdin.push('\n');
        }
        let (status, stdout, stderr) = self.run(stdin.into_bytes())?;
        let stderr = tail(&stderr);
        if !status.success() {
            return Err(self.error(&format!("exited with {status}{stderr}")));
        }
        let text = String::from_utf8_lossy(&stdout);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.len() != inputs.len() {
            return Err(self.error(&format!(
                "printed {} line(s) for {} responses: one number per response and line{stderr}",
                lines.len(),
                inputs.len()
            )));
        }
        lines
            .iter()
            .enumerate()
            .map(|(i, line)| match serde_json::from_str::<f64>(line.trim()) {
                Ok(v) if v.is_finite() => Ok(v),
                _ => Err(self.error(&format!(
                    "printed {line:?} for response {} of {}, not a finite number{stderr}",
                    i + 1,
                    inputs.len()
                ))),
            })
            .collect()
    }

    /// Runs the command on `stdin` to its end or its deadline: its status, stdout and stderr.
    fn run(&self, stdin: Vec<u8>) -> Result<(std::process::ExitStatus, Vec<u8>, Vec<u8>)> {
        let mut child = Command::new("sh")
            .args(["-c", &self.command])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| self.error(&format!("cannot start: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        // Writing and reading on their own threads: a command that reads nothing, or prints
        // much before reading, blocks neither side; each sends what it got when its pipe closes.
        let mut input = child.stdin.take();
        std::thread::spawn(move || {
            if let Some(pipe) = input.as_mut() {
                let _ = pipe.write_all(&stdin);
            }
        });
        let out = read_all(child.stdout.take());
        let err = read_all(child.stderr.take());
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    kill(&mut child);
                    return Err(
                        self.error(&format!("did not finish within {:?}: killed", self.timeout))
                    );
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => {
                    kill(&mut child);
                    return Err(self.error(&format!("waiting for it: {e}")));
                }
            }
        };
        // What it started may hold the pipes open after it exits: the deadline bounds that too.
        let left = deadline.saturating_duration_since(Instant::now());
        let stdout = out.recv_timeout(left);
        let stderr = err.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        kill(&mut child);
        match stdout {
            Ok(stdout) => Ok((status, stdout, stderr.unwrap_or_default())),
            Err(_) => Err(self.error(&format!(
                "exited, but what it started kept its output open past {:?}: killed",
                self.timeout
            ))),
        }
    }

    fn error(&self, what: &str) -> RecipeError {
        RecipeError::Reward(format!("--reward-command {:?} {what}", self.command))
    }
}

/// Everything `pipe` yields until it closes, sent on the returned channel.
fn read_all(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        let _ = tx.send(bytes);
    });
    rx
}

/// Kills the command's process group (it and what it started) and reaps it.
fn kill(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on the group the child leads (`process_group(0)`); no memory is shared.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last 400 characters of a command's stderr, as `; stderr: …` (nothing when empty).
fn tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let start = text.char_indices().rev().nth(399).map_or(0, |(i, _)| i);
    format!("; stderr: {}", &text[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(script: &str, timeout_ms: u64) -> RewardCommand {
        RewardCommand {
            command: script.into(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn inputs() -> Vec<RewardInput<'static>> {
        vec![
            RewardInput {
                prompt: "Q: 2 + 2?\n",
                completion: "4\n#### 4",
                answer: "4",
            },
            RewardInput {
                prompt: "Q: \"quoted\"",
                completion: "5",
                answer: "4",
            },
        ]
    }

    #[test]
    fn a_command_reads_json_lines_and_its_numbers_are_the_rewards() {
        // Reward: 1 when the completion's last word is the answer, else the negative length of
        // the completion; in awk, reading the JSON the protocol sends.
        let script = r#"while IFS= read -r line; do
            case "$line" in *'"completion":"4\n#### 4"'*'"answer":"4"'*) echo 1 ;; *) echo -2.5e-1 ;; esac
        done"#;
        let got = command(script, 10_000).score(&inputs()).unwrap();
        assert_eq!(got, [1.0, -0.25]);
        assert!(command("exit 7", 10_000).score(&[]).unwrap().is_empty());
    }

    #[test]
    fn a_failing_hanging_or_wordy_command_is_named_and_returns_no_reward() {
        let cases = [
            (
                "echo boom >&2; exit 3",
                "exited with exit status: 3; stderr: boom",
            ),
            (
                "cat >/dev/null; echo 1; echo x",
                "printed \"x\" for response 2 of 2",
            ),
            (
                "cat >/dev/null; echo 1",
                "printed 1 line(s) for 2 responses",
            ),
            ("cat >/dev/null; echo 1; echo NaN", "not a finite number"),
            ("sleep 30", "did not finish within"),
            ("(sleep 30 &) ; echo 1; echo 2", "kept its output open"),
            ("no-such-reward-program-odc", "exited with exit status: 127"),
        ];
        for (script, named) in cases {
            let t = Instant::now();
            let err = command(script, 500)
                .score(&inputs())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(named) && err.contains("--reward-command"),
                "{script}: {err}"
            );
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{script}: {:?}",
                t.elapsed()
            );
        }
    }
}
