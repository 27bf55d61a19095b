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
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use odc_actors::policy::clock::Timestamp;
use odc_actors::policy::stats::{SpanKind, StepStats};

/// Process id used for every event.
const PID: u64 = 1;

/// What went wrong writing a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be written.
    #[error("cannot write trace {}", path.display())]
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

/// `d` in microseconds, keeping fractions, as a JSON number (always with a fraction or exponent,
/// so readers see a float; a `Duration` is never `NaN` or infinite).
fn micros(d: Duration) -> String {
    format!("{:?}", d.as_nanos() as f64 / 1_000.0)
}

/// `s` as a JSON string literal: quotes, backslashes and control characters escaped (RFC 8259 §7).
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                // Writing into a String cannot fail.
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The trace of `spans` as Trace Event Format JSON text:
/// `{"traceEvents":[...],"displayTimeUnit":"ms"}`, one event per line.
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
/// let json = chrome_trace(&spans, "odc bench");
/// assert!(json.contains(r#"{"name":"compute","cat":"compute","ph":"X","ts":2000.0,"dur":1500.0,"pid":1,"tid":0}"#));
/// ```
pub fn chrome_trace(spans: &[TraceSpan], process_name: &str) -> String {
    let trainers: BTreeSet<usize> = spans.iter().map(|s| s.trainer).collect();
    let mut events = Vec::with_capacity(1 + 2 * trainers.len() + spans.len());
    events.push(format!(
        r#"{{"name":"process_name","ph":"M","pid":{PID},"tid":0,"args":{{"name":{}}}}}"#,
        json_string(process_name)
    ));
    for &t in &trainers {
        events.push(format!(
            r#"{{"name":"thread_name","ph":"M","pid":{PID},"tid":{t},"args":{{"name":"trainer {t}"}}}}"#
        ));
        events.push(format!(
            r#"{{"name":"thread_sort_index","ph":"M","pid":{PID},"tid":{t},"args":{{"sort_index":{t}}}}}"#
        ));
    }
    events.extend(spans.iter().map(|s| {
        let name = json_string(&s.name);
        format!(
            r#"{{"name":{name},"cat":{name},"ph":"X","ts":{},"dur":{},"pid":{PID},"tid":{}}}"#,
            micros(s.start),
            micros(s.duration),
            s.trainer
        )
    }));
    format!(
        "{{\"traceEvents\":[\n{}\n],\"displayTimeUnit\":\"ms\"}}\n",
        events.join(",\n")
    )
}

/// Writes [`chrome_trace`] of `spans` to `path`.
pub fn write_chrome_trace(
    path: &Path,
    spans: &[TraceSpan],
    process_name: &str,
) -> Result<(), TraceError> {
    std::fs::write(path, chrome_trace(spans, process_name)).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The spans of one step's micro-batches (compute, pull and push waits) relative to `origin`, and
/// per trainer `0..trainers` a barrier wait from its last micro-batch to the step's end.
pub fn step_spans(stats: &StepStats, origin: Timestamp, devices: usize) -> Vec<TraceSpan> {
    let rel = |t: Timestamp| t.saturating_duration_since(origin);
    let mut out = Vec::new();
    for r in &stats.micro_batch_log {
        // A gang member's compute names its gang, so the members line up in the trace.
        let gang = (!r.pieces.is_empty()).then(|| {
            let each: Vec<String> = r
                .pieces
                .iter()
                .map(|p| {
                    format!(
                        "gang {} of sample {}: member {} of {}",
                        p.gang, p.sample.index, p.member, p.members
                    )
                })
                .collect();
            format!(" ({})", each.join("; "))
        });
        for s in &r.spans {
            let mut name = s.kind.name().to_string();
            if let (SpanKind::Compute, Some(gang)) = (s.kind, &gang) {
                name.push_str(gang);
            }
            out.push(TraceSpan {
                trainer: r.trainer as usize,
                name,
                start: rel(s.start),
                duration: s.end.saturating_duration_since(s.start),
            });
        }
    }
    let end = stats.started + stats.wall;
    for t in 0..devices {
        let last = stats
            .micro_batch_log
            .iter()
            .filter(|r| r.trainer == t as u32)
            .map(|r| r.finished)
            .max()
            .unwrap_or(stats.started);
        out.push(TraceSpan {
            trainer: t,
            name: SpanKind::BarrierWait.name().to_string(),
            start: rel(last),
            duration: end.saturating_duration_since(last),
        });
    }
    out
}

/// Where the trainers' time went: the total of each span name over `spans`, in order of first
/// appearance (the per-phase summary beside a trace: compute, pull wait, push wait, barrier
/// wait), as `name total_s` pairs joined by commas.
pub fn phase_totals(spans: &[TraceSpan]) -> String {
    let mut totals: Vec<(&str, Duration)> = Vec::new();
    for span in spans {
        // A gang member's compute carries its gang in the name: the phase is the first words.
        let phase = span.name.split(" (").next().unwrap_or(&span.name);
        match totals.iter_mut().find(|(name, _)| *name == phase) {
            Some((_, total)) => *total += span.duration,
            None => totals.push((phase, span.duration)),
        }
    }
    totals
        .iter()
        .map(|(name, total)| format!("{name} {:.3} s", total.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn phase_totals_add_up_each_phase_across_trainers_and_gangs() {
        let spans = vec![
            span(0, "compute", 0, 1_000_000),
            span(1, "pull wait", 0, 250_000),
            span(1, "compute (gang 0 of sample 3: member 1 of 2)", 0, 500_000),
            span(0, "pull wait", 0, 250_000),
        ];
        assert_eq!(phase_totals(&spans), "compute 1.500 s, pull wait 0.500 s");
        assert_eq!(phase_totals(&[]), "");
    }

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

    /// The trace parsed back by a real JSON parser.
    fn parsed(spans: &[TraceSpan], process_name: &str) -> Value {
        let text = chrome_trace(spans, process_name);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    fn events(trace: &Value) -> &Vec<Value> {
        trace["traceEvents"].as_array().unwrap()
    }

    #[test]
    fn a_gang_members_compute_names_its_gang() {
        let t = |us: u64| Timestamp::from_nanos(us * 1000);
        let record = |trainer: u32, pieces| crate::MicroBatchRecord {
            micro_batch: trainer,
            trainer,
            started: t(0),
            finished: t(10),
            tokens: 5,
            cost: 1.0,
            spans: vec![
                crate::Span {
                    kind: SpanKind::PullWait,
                    start: t(0),
                    end: t(2),
                },
                crate::Span {
                    kind: SpanKind::Compute,
                    start: t(2),
                    end: t(10),
                },
            ],
            pieces,
        };
        let piece = |member| odc_actors::batch::Piece {
            sample: crate::SampleMeta::new(7, 9000),
            epoch: 0,
            gang: 3,
            member,
            members: 2,
            ranks: vec![0, 1],
        };
        let stats = StepStats {
            step: 0,
            loss: 1.0,
            tokens: 10,
            samples: 1,
            micro_batches: 2,
            grad_norm: 1.0,
            replays: 0,
            started: t(0),
            wall: Duration::from_micros(12),
            trainers: Vec::new(),
            micro_batch_log: vec![record(0, vec![piece(0)]), record(1, Vec::new())],
            skipped: None,
            gangs: vec![2],
            early_relay_flushes: 0,
        };
        let names: Vec<String> = step_spans(&stats, t(0), 2)
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert!(names.contains(&"compute (gang 3 of sample 7: member 0 of 2)".to_string()));
        assert!(names.contains(&"compute".to_string()), "{names:?}");
        assert!(names.contains(&"pull wait".to_string()));
    }

    #[test]
    fn one_complete_event_per_span_plus_metadata() {
        let trace = parsed(&spans(), "odc");
        let ev = events(&trace);
        let complete = ev.iter().filter(|e| e["ph"] == "X").count();
        let meta = ev.iter().filter(|e| e["ph"] == "M").count();
        assert_eq!(complete, 5);
        // process_name + (thread_name, thread_sort_index) for trainers 0 and 2.
        assert_eq!(meta, 1 + 2 * 2);
        assert_eq!(ev.len(), complete + meta);
        assert_eq!(trace["displayTimeUnit"], "ms");
        assert_eq!(trace.as_object().unwrap().len(), 2);
    }

    #[test]
    fn ts_and_dur_are_microseconds() {
        let s = [TraceSpan {
            trainer: 1,
            name: "compute".into(),
            start: Duration::from_millis(3),
            duration: Duration::from_nanos(1_500),
        }];
        let trace = parsed(&s, "odc");
        let x = events(&trace).iter().find(|e| e["ph"] == "X").unwrap();
        assert!(x["ts"].is_f64() && x["dur"].is_f64(), "{x}");
        assert_eq!(x["ts"].as_f64(), Some(3_000.0));
        assert_eq!(x["dur"].as_f64(), Some(1.5));
        assert_eq!(x["name"], "compute");
        assert_eq!(x["cat"], "compute");
        assert_eq!(x["pid"], 1);
        // Extreme durations stay valid numbers.
        let far = [TraceSpan {
            trainer: 0,
            name: "compute".into(),
            start: Duration::MAX,
            duration: Duration::from_nanos(1),
        }];
        let trace = parsed(&far, "odc");
        let x = events(&trace).iter().find(|e| e["ph"] == "X").unwrap();
        assert!(x["ts"].as_f64().unwrap() > 1e21);
        assert_eq!(x["dur"].as_f64(), Some(0.001));
    }

    #[test]
    fn metadata_names_process_and_trainers_in_order() {
        let trace = parsed(&spans(), "odc bench ab");
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
        let trace = parsed(&s, "odc");
        let xs: Vec<&Value> = events(&trace).iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(xs.len(), s.len());
        for (x, span) in xs.iter().zip(&s) {
            assert_eq!(x["tid"].as_u64(), Some(span.trainer as u64));
            assert_eq!(x["name"], span.name.as_str());
            assert_eq!(x["ts"].as_f64(), Some(span.start.as_micros() as f64));
        }
    }

    #[test]
    fn names_are_escaped() {
        let awkward =
            "a \"quoted\" \\ path\nwith\ttabs\r\u{08}\u{0c}\u{01}\u{1f} and ünïcödé ✓ \u{2028}";
        let trace = parsed(&[span(0, awkward, 0, 1)], awkward);
        let ev = events(&trace);
        assert_eq!(ev[0]["args"]["name"], awkward);
        let x = ev.iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!(x["name"], awkward);
        assert_eq!(x["cat"], awkward);
        assert_eq!(json_string("\u{00}"), "\"\\u0000\"");
    }

    #[test]
    fn empty_trace_has_only_process_metadata() {
        let trace = parsed(&[], "odc");
        assert_eq!(events(&trace).len(), 1);
    }

    #[test]
    fn written_file_parses_back() {
        let path = crate::test_util::temp_path("odc-trace", "trace.json");
        write_chrome_trace(&path, &spans(), "odc").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, parsed(&spans(), "odc"));
        std::fs::remove_file(&path).unwrap();

        let bad = path.join("nested").join("trace.json");
        let err = write_chrome_trace(&bad, &spans(), "odc").unwrap_err();
        assert!(matches!(&err, TraceError::Io { path: p, .. } if p == &bad));
        assert!(err.to_string().contains("trace.json"), "{err}");
    }
}
