//! A loader for chat JSONL, the format TRL, axolotl and verl users keep: one conversation per line,
//! `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}`.
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Whole or nothing**: [`load`] returns every conversation of the file in order, or the
//!    first malformed line as [`TextError::Malformed`] naming the file, the 1-based line and what
//!    was wrong: not UTF-8, not JSON, not an object, no `messages` list, a message that is not an
//!    object, a missing or non-string `role` or `content` (naming the message's index), a role
//!    other than `system`, `user`, `assistant` and `tool`, a conversation with no assistant turn
//!    (nothing to learn), or a blank line before a record. Other fields (of the line and of each
//!    message) are ignored; blank lines at the end are allowed.
//! 2. A file that cannot be opened is [`TextError::Open`] naming its path.

use std::path::Path;

use serde_json::Value;

use super::chat::{Message, ROLES};
use super::jsonl::{kind, read_records};
use super::TextError;

/// Reads every conversation of the chat JSONL file at `path`.
///
/// ```no_run
/// use odc_text::{conversation, HfTokenizer, Sample};
/// let tokenizer = HfTokenizer::from_dir("Qwen2.5-0.5B-Instruct".as_ref())?;
/// let samples = conversation::load("chats.jsonl")?
///     .iter()
///     .map(|messages| Sample::from_chat(&tokenizer, messages))
///     .collect::<Result<Vec<_>, _>>()?;
/// # Ok::<(), odc_text::TextError>(())
/// ```
pub fn load(path: impl AsRef<Path>) -> Result<Vec<Vec<Message>>, TextError> {
    read_records(path.as_ref(), parse_record)
}

/// One line's conversation, or what is wrong with it.
fn parse_record(text: &str) -> Result<Vec<Message>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(object) = value else {
        return Err(format!("expected a JSON object, got {}", kind(&value)));
    };
    let messages = match object.get("messages") {
        None => return Err("missing field \"messages\"".into()),
        Some(Value::Array(messages)) => messages,
        Some(other) => return Err(format!("field \"messages\" is {}, not a list", kind(other))),
    };
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, message)| parse_message(message).map_err(|e| format!("messages[{i}]: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    if !messages.iter().any(|m| m.role == "assistant") {
        return Err(format!(
            "no assistant turn among its {} messages: nothing to learn",
            messages.len()
        ));
    }
    Ok(messages)
}

/// One message, or what is wrong with it.
fn parse_message(value: &Value) -> Result<Message, String> {
    let Value::Object(object) = value else {
        return Err(format!("expected an object, got {}", kind(value)));
    };
    let field = |name: &str| -> Result<String, String> {
        match object.get(name) {
            None => Err(format!("missing field \"{name}\"")),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("field \"{name}\" is {}, not a string", kind(other))),
        }
    };
    let role = field("role")?;
    if !ROLES.contains(&role.as_str()) {
        return Err(format!("role {role:?} is not one of {}", ROLES.join(", ")));
    }
    Ok(Message {
        role,
        content: field("content")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizers::TempDir;

    const GOOD: &str = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]}"#;

    #[test]
    fn whole_or_nothing_good_lines_in_order_with_blank_trailing_lines() {
        let dir = TempDir::new("chat-jsonl-good");
        let other = r#"{"id": 7, "messages": [{"role": "user", "content": "", "name": "x"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "{}"}]}"#;
        let path = dir.write("good.jsonl", &format!("{GOOD}\n{other}\n\n  \n"));
        let conversations = load(&path).expect("valid file");
        assert_eq!(
            conversations,
            vec![
                vec![
                    Message::system("Be brief."),
                    Message::user("2 + 3?"),
                    Message::assistant("5")
                ],
                vec![
                    Message::user(""),
                    Message::assistant("ok"),
                    Message::new("tool", "{}")
                ],
            ]
        );
        let empty = dir.write("empty.jsonl", "");
        assert_eq!(
            load(&empty).expect("no records"),
            Vec::<Vec<Message>>::new()
        );
    }

    #[test]
    fn whole_or_nothing_each_malformed_line_is_named_with_its_line_number() {
        let dir = TempDir::new("chat-jsonl-bad");
        let user = r#"{"role": "user", "content": "q"}"#;
        let cases: [(String, &str); 13] = [
            ("{\"messages\": [".into(), "not valid JSON"),
            ("[1]".into(), "expected a JSON object, got an array"),
            ("{\"conversation\": []}".into(), "missing field \"messages\""),
            (
                "{\"messages\": \"hi\"}".into(),
                "field \"messages\" is a string, not a list",
            ),
            (
                format!("{{\"messages\": [{user}, 7]}}"),
                "messages[1]: expected an object, got a number",
            ),
            (
                "{\"messages\": [{\"content\": \"q\"}]}".into(),
                "messages[0]: missing field \"role\"",
            ),
            (
                format!("{{\"messages\": [{user}, {{\"role\": \"bot\", \"content\": \"a\"}}]}}"),
                "messages[1]: role \"bot\" is not one of system, user, assistant, tool",
            ),
            (
                format!("{{\"messages\": [{user}, {{\"role\": \"assistant\"}}]}}"),
                "messages[1]: missing field \"content\"",
            ),
            (
                format!(
                    "{{\"messages\": [{user}, {{\"role\": \"assistant\", \"content\": [{{\"type\": \"text\"}}]}}]}}"
                ),
                "messages[1]: field \"content\" is an array, not a string",
            ),
            (
                format!("{{\"messages\": [{user}, {{\"role\": null, \"content\": \"a\"}}]}}"),
                "messages[1]: field \"role\" is null, not a string",
            ),
            (
                format!("{{\"messages\": [{user}, {user}]}}"),
                "no assistant turn among its 2 messages: nothing to learn",
            ),
            (
                "{\"messages\": []}".into(),
                "no assistant turn among its 0 messages: nothing to learn",
            ),
            ("\n".into(), "blank line before a record"),
        ];
        for (i, (bad, reason)) in cases.iter().enumerate() {
            let path = dir.write(
                &format!("bad{i}.jsonl"),
                &format!("{GOOD}\n{bad}\n{GOOD}\n"),
            );
            let err = load(&path).expect_err("malformed");
            let message = err.to_string();
            let prefix = format!("{}:2: {reason}", path.display());
            assert!(
                message.starts_with(&prefix),
                "{message:?} should start with {prefix:?}"
            );
            assert!(matches!(err, TextError::Malformed { line: 2, .. }));
        }
        let mut bytes = format!("{GOOD}\n").into_bytes();
        bytes.extend_from_slice(b"{\"messages\": \"\xff\"}\n");
        let path = dir.0.join("not-utf8.jsonl");
        std::fs::write(&path, bytes).expect("write");
        let err = load(&path).expect_err("not UTF-8");
        assert_eq!(
            err.to_string(),
            format!("{}:2: not valid UTF-8", path.display())
        );
    }

    #[test]
    fn a_file_that_cannot_be_opened_names_its_path() {
        let dir = TempDir::new("chat-jsonl-missing");
        let path = dir.0.join("missing.jsonl");
        let err = load(&path).expect_err("no such file");
        assert!(matches!(err, TextError::Open { .. }));
        assert_eq!(err.to_string(), format!("cannot open {}", path.display()));
    }
}
