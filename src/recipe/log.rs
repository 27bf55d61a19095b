//! [`Log`]: every figure a run logs, at its step, written where the run's flags ask: a JSONL file
//! (`--log-jsonl PATH`, one object per record, as Hugging Face's `Trainer` keeps its
//! `log_history`) and TensorBoard event files (`--tensorboard DIR`, [`super::tensorboard`]).
//!
//! Guarantees:
//! - A record is `{"step": n, "<name>": value, …}` in the order given; a value that is not
//!   finite is written `null` in JSON (JSON has no NaN) and left out of TensorBoard.
//! - Each record is flushed before [`Log::record`] returns: a run that dies leaves every record
//!   before it whole; a JSONL file is appended to, so a resumed run continues it.
//! - Only the process that logs (the lead) opens the files.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Number, Value};

use super::tensorboard::EventWriter;
use super::{RecipeError, Result};

/// Where a run's figures go (see the [module docs](self)).
#[derive(Debug, Default)]
pub struct Log {
    jsonl: Option<(PathBuf, BufWriter<File>)>,
    tensorboard: Option<EventWriter>,
}

impl Log {
    /// A log to `jsonl` (appended to, made if missing) and to a new event file in `tensorboard`;
    /// neither: a log that writes nothing.
    pub fn open(jsonl: Option<&Path>, tensorboard: Option<&Path>) -> Result<Log> {
        let jsonl = match jsonl {
            Some(path) => {
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| RecipeError::Io {
                        context: format!("--log-jsonl {}", path.display()),
                        source,
                    })?;
                Some((path.to_path_buf(), BufWriter::new(file)))
            }
            None => None,
        };
        let tensorboard = tensorboard.map(EventWriter::create).transpose()?;
        Ok(Log { jsonl, tensorboard })
    }

    /// Whether any file is written.
    pub fn is_on(&self) -> bool {
        self.jsonl.is_some() || self.tensorboard.is_some()
    }

    /// The figures of step `step`, as `(name, value)`.
    pub fn record(&mut self, step: u64, figures: &[(&str, f64)]) -> Result<()> {
        if let Some((path, file)) = &mut self.jsonl {
            let line = json_line(step, figures);
            writeln!(file, "{line}")
                .and_then(|()| file.flush())
                .map_err(|source| RecipeError::Io {
                    context: format!("writing --log-jsonl {}", path.display()),
                    source,
                })?;
        }
        if let Some(tb) = &mut self.tensorboard {
            let finite: Vec<(&str, f64)> = figures
                .iter()
                .copied()
                .filter(|(_, v)| v.is_finite())
                .collect();
            tb.scalars(step, &finite)?;
        }
        Ok(())
    }
}

/// One record as a JSON object on one line, its keys in the order given.
fn json_line(step: u64, figures: &[(&str, f64)]) -> String {
    let mut line = format!("{{\"step\": {step}");
    for (name, value) in figures {
        let value = Number::from_f64(*value).map_or(Value::Null, Value::Number);
        line += &format!(", {}: {value}", Value::from(*name));
    }
    line + "}"
}

/// One record read back: its step and its figures.
pub type Record = (u64, Vec<(String, f64)>);

/// The records of a JSONL log, in order: each line's step and figures (in name order; `null`
/// read as NaN).
pub fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    let io = |source| RecipeError::Io {
        context: format!("reading {}", path.display()),
        source,
    };
    let mut records = Vec::new();
    for (n, line) in BufReader::new(File::open(path).map_err(io)?)
        .lines()
        .enumerate()
    {
        let line = line.map_err(io)?;
        let bad =
            |what: &str| RecipeError::Invalid(format!("{} line {}: {what}", path.display(), n + 1));
        let Ok(Value::Object(object)) = serde_json::from_str::<Value>(&line) else {
            return Err(bad("not a JSON object"));
        };
        let step = object.get("step").and_then(Value::as_u64);
        let step = step.ok_or_else(|| bad("no \"step\" of 0 or more"))?;
        let mut figures = Vec::new();
        for (name, value) in object.into_iter().filter(|(name, _)| name != "step") {
            let value = match value {
                Value::Null => f64::NAN,
                v => v
                    .as_f64()
                    .ok_or_else(|| bad(&format!("\"{name}\" is not a number")))?,
            };
            figures.push((name, value));
        }
        records.push((step, figures));
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::super::tensorboard::{event_files, read_events};
    use super::*;

    #[test]
    fn records_round_trip_through_jsonl_and_tensorboard_and_a_resumed_run_appends() {
        let dir = std::env::temp_dir().join(format!("odc-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let jsonl = dir.join("log.jsonl");
        let tb = dir.join("tb");
        let mut log = Log::open(Some(&jsonl), Some(&tb)).unwrap();
        assert!(log.is_on());
        log.record(1, &[("loss", 2.5), ("mfu", 0.0125)]).unwrap();
        log.record(2, &[("loss", f64::NAN), ("tokens_per_s", 1e3 / 3.0)])
            .unwrap();
        drop(log);
        let mut log = Log::open(Some(&jsonl), None).unwrap();
        log.record(3, &[("eval_loss", 1.0)]).unwrap();
        drop(log);

        let records = read_jsonl(&jsonl).unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(
            records[0],
            (1, vec![("loss".into(), 2.5), ("mfu".into(), 0.0125)])
        );
        // f64 exactly; NaN as null and back.
        assert_eq!(records[1].1[1], ("tokens_per_s".into(), 1e3 / 3.0));
        assert!(records[1].1[0].1.is_nan());
        assert_eq!(records[2], (3, vec![("eval_loss".into(), 1.0)]));

        let files = event_files(&tb).unwrap();
        assert_eq!(files.len(), 1);
        let events = read_events(&files[0]).unwrap();
        let scalars: Vec<(i64, Vec<(String, f32)>)> = events[1..]
            .iter()
            .map(|e| (e.step, e.scalars.clone()))
            .collect();
        assert_eq!(
            scalars,
            [
                (1, vec![("loss".into(), 2.5), ("mfu".into(), 0.0125)]),
                // The NaN is left out.
                (2, vec![("tokens_per_s".into(), (1e3f64 / 3.0) as f32)]),
            ]
        );
        std::fs::write(&jsonl, "{\"loss\": 1}\n").unwrap();
        let err = read_jsonl(&jsonl).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("step"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_path_is_named() {
        let err = Log::open(Some(Path::new("/nonexistent/dir/log.jsonl")), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--log-jsonl /nonexistent/dir/log.jsonl"),
            "{err}"
        );
    }
}
