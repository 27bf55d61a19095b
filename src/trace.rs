//! Per-trainer timelines as Chrome / Perfetto trace JSON (the Trace Event Format), for
//! `chrome://tracing` or <https://ui.perfetto.dev>.
//!
//! # Guarantees
//!
//! - One process (`pid` 1) named by the caller; one thread per trainer (`tid` = trainer index) named
//!   `trainer N` and sorted by `N`.
//! - Exactly one complete event (`"ph":"X"`) per [`TraceSpan`], in the order given, with `ts` (start
//!   since the run's start) and `dur` in microseconds as floating-point numbers (sub-microsecond
//!   precision kept); `name` and `cat` are the span's name.
//! - Metadata events (`"ph":"M"`) come first: `process_name`, then `thread_name` and
//!   `thread_sort_index` for every trainer that has at least one span.
//! - `displayTimeUnit` is `"ms"`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

/// Process id used for every event.
const PID: u64 = 1;

/// What went wrong writing a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be written.
    #[error("cannot write trace {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// One interval of a trainer's timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpan {
    /// Trainer index; becomes the trace's thread id.
    pub trainer: usize,
    /// What the trainer was doing: `"compute"`, `"pull wait"`, `"push wait"`, `"barrier wait"` or
    /// `"collective wait"`.
    pub name: String,
    /// Start, measured from the run's start.
    pub start: Duration,
    /// Length of the span.
    pub duration: Duration,
}

/// `d` in microseconds, keeping fractions.
fn micros(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1_000.0
}

/// The trace of `spans` as a Trace Event Format object:
/// `{"traceEvents":[...], "displayTimeUnit":"ms"}`.
///
/// ```
/// use std::time::Duration;
/// use odc::trace::{chrome_trace, TraceSpan};
/// let spans = [TraceSpan {
///     trainer: 0,
///     name: "compute".into(),
///     start: Duration::from_millis(2),
///     duration: Duration::from_micros(1500),
/// }];
/// let trace = chrome_trace(&spans, "odc bench");
/// let x = trace["traceEvents"].as_array().unwrap().iter().find(|e| e["ph"] == "X").unwrap();
/// assert_eq!(x["ts"], 2000.0);
/// assert_eq!(x["dur"], 1500.0);
/// assert_eq!(x["tid"], 0);
/// ```
pub fn chrome_trace(spans: &[TraceSpan], process_name: &str) -> Value {
    let trainers: BTreeSet<usize> = spans.iter().map(|s| s.trainer).collect();
    let mut events = Vec::with_capacity(1 + 2 * trainers.len() + spans.len());
    events.push(json!({
        "name": "process_name",
        "ph": "M",
        "pid": PID,
        "tid": 0,
        "args": { "name": process_name },
    }));
    for &t in &trainers {
        events.push(json!({
            "name": "thread_name",
            "ph": "M",
            "pid": PID,
            "tid": t,
            "args": { "name": format!("trainer {t}") },
        }));
        events.push(json!({
            "name": "thread_sort_index",
            "ph": "M",
            "pid": PID,
            "tid": t,
            "args": { "sort_index": t },
        }));
    }
    events.extend(spans.iter().map(|s| {
        json!({
            "name": s.name,
            "cat": s.name,
            "ph": "X",
            "ts": micros(s.start),
            "dur": micros(s.duration),
            "pid": PID,
            "tid": s.trainer,
        })
    }));
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Writes [`chrome_trace`] of `spans` to `path`.
pub fn write_chrome_trace(
    path: &Path,
    spans: &[TraceSpan],
    process_name: &str,
) -> Result<(), TraceError> {
    let text = chrome_trace(spans, process_name).to_string();
    std::fs::write(path, text).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(trainer: usize, name: &str, start_us: u64, dur_us: u64) -> TraceSpan {
        TraceSpan {
            trainer,
            name: name.into(),
            start: Duration::from_micros(start_us),
            duration: Duration::from_micros(dur_us),
        }
    }

    fn spans() -> Vec<TraceSpan> {
        vec![
            span(2, "compute", 0, 1_500),
            span(0, "compute", 0, 1_000),
            span(0, "pull wait", 1_000, 250),
            span(2, "barrier wait", 1_500, 500),
            span(0, "push wait", 1_250, 100),
        ]
    }

    fn events(trace: &Value) -> &Vec<Value> {
        trace["traceEvents"].as_array().unwrap()
    }

    #[test]
    fn one_complete_event_per_span_plus_metadata() {
        let trace = chrome_trace(&spans(), "odc");
        let ev = events(&trace);
        let complete = ev.iter().filter(|e| e["ph"] == "X").count();
        let meta = ev.iter().filter(|e| e["ph"] == "M").count();
        assert_eq!(complete, 5);
        // process_name + (thread_name, thread_sort_index) for trainers 0 and 2.
        assert_eq!(meta, 1 + 2 * 2);
        assert_eq!(ev.len(), complete + meta);
        assert_eq!(trace["displayTimeUnit"], "ms");
    }

    #[test]
    fn ts_and_dur_are_microseconds() {
        let s = [TraceSpan {
            trainer: 1,
            name: "compute".into(),
            start: Duration::from_millis(3),
            duration: Duration::from_nanos(1_500),
        }];
        let trace = chrome_trace(&s, "odc");
        let x = events(&trace).iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!(x["ts"].as_f64(), Some(3_000.0));
        assert_eq!(x["dur"].as_f64(), Some(1.5));
        assert_eq!(x["name"], "compute");
        assert_eq!(x["cat"], "compute");
        assert_eq!(x["pid"], 1);
    }

    #[test]
    fn metadata_names_process_and_trainers_in_order() {
        let trace = chrome_trace(&spans(), "odc bench ab");
        let ev = events(&trace);
        let process = ev.iter().find(|e| e["name"] == "process_name").unwrap();
        assert_eq!(process["args"]["name"], "odc bench ab");
        assert_eq!(process["ph"], "M");
        let names: Vec<(u64, &str)> = ev
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(names, [(0, "trainer 0"), (2, "trainer 2")]);
        let sort: Vec<(u64, u64)> = ev
            .iter()
            .filter(|e| e["name"] == "thread_sort_index")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["sort_index"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(sort, [(0, 0), (2, 2)]);
        // Metadata precedes the spans.
        let first_x = ev.iter().position(|e| e["ph"] == "X").unwrap();
        assert!(ev[..first_x].iter().all(|e| e["ph"] == "M"));
    }

    #[test]
    fn tids_match_trainers_in_span_order() {
        let s = spans();
        let trace = chrome_trace(&s, "odc");
        let xs: Vec<&Value> = events(&trace).iter().filter(|e| e["ph"] == "X").collect();
        for (x, span) in xs.iter().zip(&s) {
            assert_eq!(x["tid"].as_u64(), Some(span.trainer as u64));
            assert_eq!(x["name"], span.name.as_str());
            assert_eq!(x["ts"].as_f64(), Some(span.start.as_micros() as f64));
        }
    }

    #[test]
    fn empty_trace_has_only_process_metadata() {
        let trace = chrome_trace(&[], "odc");
        assert_eq!(events(&trace).len(), 1);
    }

    #[test]
    fn written_file_parses_back() {
        let path = crate::test_util::temp_path("odc-trace", "trace.json");
        write_chrome_trace(&path, &spans(), "odc").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, chrome_trace(&spans(), "odc"));
        std::fs::remove_file(&path).unwrap();

        let bad = path.join("nested").join("trace.json");
        let err = write_chrome_trace(&bad, &spans(), "odc").unwrap_err();
        assert!(matches!(&err, TraceError::Io { path: p, .. } if p == &bad));
        assert!(err.to_string().contains("trace.json"), "{err}");
    }
}
