//! The JSONL reading the loaders share: one record per line, every malformed line an error naming
//! the file, the 1-based line and what was wrong.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind};
use std::path::Path;

use serde_json::Value;

use super::TextError;

/// Every record of the JSONL file at `path` in order, each line parsed by `parse` (which says what
/// is wrong with a line it refuses). A line that is not UTF-8, or a blank line before a record, is
/// malformed; blank lines at the end are allowed.
pub(super) fn read_records<T>(
    path: &Path,
    mut parse: impl FnMut(&str) -> Result<T, String>,
) -> Result<Vec<T>, TextError> {
    let file = File::open(path).map_err(|source| TextError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let malformed = |line: usize, reason: String| TextError::Malformed {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut records = Vec::new();
    let mut first_blank = None;
    for (i, text) in BufReader::new(file).lines().enumerate() {
        let line = i + 1;
        let text = match text {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::InvalidData => {
                return Err(malformed(line, "not valid UTF-8".into()));
            }
            Err(source) => {
                return Err(TextError::Read {
                    path: path.to_path_buf(),
                    line,
                    source,
                })
            }
        };
        if text.trim().is_empty() {
            first_blank.get_or_insert(line);
            continue;
        }
        if let Some(blank) = first_blank {
            return Err(malformed(blank, "blank line before a record".into()));
        }
        records.push(parse(&text).map_err(|reason| malformed(line, reason))?);
    }
    Ok(records)
}

/// A JSON value's kind, with its article.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
