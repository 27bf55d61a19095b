//! A loader for GSM8K-format JSONL: one `{"question": "...", "answer": "..."}` object per line.
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Whole or nothing**: [`load`] returns every record of the file in order, or the first
//!    malformed line as [`TextError::Malformed`] naming the file, the 1-based line and what was
//!    wrong: not UTF-8, not JSON, not an object, a missing or non-string `question` or `answer`,
//!    an empty (all-whitespace) question or answer, or a blank line before a record. Other fields
//!    are ignored; blank lines at the end are allowed.
//! 2. A file that cannot be opened is [`TextError::Open`] naming its path.
//!
//! GSM8K's answers keep their `<<48/2=24>>` calculator annotations; [`Problem::final_answer`]
//! reads the `####` line either way.

use std::path::Path;

use serde_json::Value;

use super::jsonl::{kind, read_records};
use super::problem::Problem;
use super::TextError;

/// Reads every problem of the GSM8K-format JSONL file at `path`.
pub fn load(path: impl AsRef<Path>) -> Result<Vec<Problem>, TextError> {
    read_records(path.as_ref(), parse_record)
}

/// One line's problem, or what is wrong with it.
fn parse_record(text: &str) -> Result<Problem, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(object) = value else {
        return Err(format!("expected a JSON object, got {}", kind(&value)));
    };
    let field = |name: &str| -> Result<String, String> {
        match object.get(name) {
            None => Err(format!("missing field \"{name}\"")),
            Some(Value::String(s)) if s.trim().is_empty() => Err(format!("empty {name}")),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("field \"{name}\" is {}, not a string", kind(other))),
        }
    };
    Ok(Problem {
        question: field("question")?,
        answer: field("answer")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::temp_path;
    use std::path::PathBuf;

    const TRAIN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/gsm8k/train.jsonl"
    );
    const TEST: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/gsm8k/test.jsonl"
    );

    /// A temporary file holding `bytes`, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, bytes: &[u8]) -> Self {
            let path = temp_path("odc-gsm8k", name);
            std::fs::write(&path, bytes).expect("write temp file");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const GOOD: &str =
        r#"{"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}"#;

    #[test]
    fn whole_or_nothing_the_shared_gsm8k_files_parse_fully() {
        for (path, expected) in [(TRAIN, 7_473), (TEST, 1_319)] {
            if !Path::new(path).exists() {
                println!(
                    "skipped: {path} is not present (the shared data sits beside the project)"
                );
                continue;
            }
            let problems = load(path).expect("the shared GSM8K file parses");
            assert_eq!(problems.len(), expected, "{path}");
            assert!(problems.iter().all(|p| p.final_answer().is_some()));
        }
    }

    #[test]
    fn whole_or_nothing_good_lines_in_order_with_blank_trailing_lines() {
        let other = "{\"question\": \"Q2\", \"answer\": \"#### 1\", \"id\": 9}";
        let file = TempFile::new("good.jsonl", format!("{GOOD}\n{other}\n\n  \n").as_bytes());
        let problems = load(&file.0).expect("valid file");
        assert_eq!(problems.len(), 2);
        assert_eq!(problems[0].final_answer(), Some("5"));
        assert_eq!(problems[1].question, "Q2");
        let empty = TempFile::new("empty.jsonl", b"");
        assert_eq!(
            load(&empty.0).expect("an empty file has no records"),
            vec![]
        );
    }

    #[test]
    fn whole_or_nothing_each_malformed_line_is_named_with_its_line_number() {
        let cases: [(&[u8], usize, &str); 11] = [
            (b"{\"question\": \"Q\"", 2, "not valid JSON"),
            (b"[1, 2]", 2, "expected a JSON object, got an array"),
            (b"{\"answer\": \"#### 1\"}", 2, "missing field \"question\""),
            (b"{\"question\": \"Q\"}", 2, "missing field \"answer\""),
            (
                b"{\"question\": 7, \"answer\": \"#### 1\"}",
                2,
                "field \"question\" is a number, not a string",
            ),
            (
                b"{\"question\": \"Q\", \"answer\": null}",
                2,
                "field \"answer\" is null, not a string",
            ),
            (
                b"{\"question\": \"  \", \"answer\": \"#### 1\"}",
                2,
                "empty question",
            ),
            (
                b"{\"question\": \"Q\", \"answer\": \"\"}",
                2,
                "empty answer",
            ),
            (
                b"{\"question\": \"Q\xff\", \"answer\": \"#### 1\"}",
                2,
                "not valid UTF-8",
            ),
            (b"\n", 2, "blank line before a record"),
            (b"   \n\n", 2, "blank line before a record"),
        ];
        for (i, (bad, line, reason)) in cases.into_iter().enumerate() {
            let mut bytes = format!("{GOOD}\n").into_bytes();
            bytes.extend_from_slice(bad);
            bytes.extend_from_slice(format!("\n{GOOD}\n").as_bytes());
            let file = TempFile::new(&format!("bad{i}.jsonl"), &bytes);
            let err = load(&file.0).expect_err("malformed");
            let message = err.to_string();
            let prefix = format!("{}:{line}: {reason}", file.0.display());
            assert!(
                message.starts_with(&prefix),
                "{message:?} should start with {prefix:?}"
            );
            assert!(matches!(err, TextError::Malformed { line: l, .. } if l == line));
        }
    }

    #[test]
    fn a_file_that_cannot_be_opened_names_its_path() {
        let path = temp_path("odc-gsm8k", "missing.jsonl");
        let err = load(&path).expect_err("no such file");
        assert!(matches!(err, TextError::Open { .. }));
        assert_eq!(err.to_string(), format!("cannot open {}", path.display()));
    }
}
