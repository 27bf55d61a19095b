//! Conversations in a model's own chat format: [`Message`]s, and [`ChatTemplate`], which renders
//! the Jinja `chat_template` of a model's `tokenizer_config.json` with `minijinja`, as
//! `transformers`' `apply_chat_template` does. A conversation becomes a training sample or a
//! prompt through a tokenizer in [`super::chat_sample`].
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Rendered as transformers renders**: Jinja with `trim_blocks` and `lstrip_blocks`, loop
//!    controls, Python's string methods (`.strip()`, `.startswith()`, …), `True`/`False`/`None`
//!    printed as Python prints them, `tojson` with Python's `json.dumps` spacing,
//!    `raise_exception(message)` (an error carrying the message), `strftime_now(format)` (UTC);
//!    the variables `messages`, `add_generation_prompt`, and `bos_token`/`eos_token` when the
//!    model has them; `tools` and `documents` are undefined. The real Qwen2.5 and Llama 3.2
//!    templates render exactly what Jinja2, set up as `transformers` sets it up, renders.
//! 2. **Errors name the template**: a template that does not compile or fails to render (an
//!    undefined function, a `raise_exception`) is [`TextError::ChatTemplate`] naming where it came
//!    from and why; nothing panics.

use std::ops::Range;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::TextError;

/// The roles a chat message may have (OpenAI's, TRL's and the chat templates').
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// One turn of a conversation, as chat JSONL files and chat templates know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl Message {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A system prompt.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A user's turn.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// The assistant's turn: what a model learns to say.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The name the template has inside its environment (and in minijinja's error locations).
const NAME: &str = "chat_template";

/// A model's Jinja chat template, ready to render conversations (guarantees 1 and 2).
///
/// ```
/// use odc_text::{ChatTemplate, Message};
/// let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n\
///               {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
/// let template = ChatTemplate::new("ChatML", chatml, None, Some("<|im_end|>".into()))?;
/// let text = template.render(&[Message::user(" Hi ")], true)?;
/// assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
/// # Ok::<(), odc_text::TextError>(())
/// ```
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors (a file, or any name), `bos_token` and
    /// `eos_token` are the texts the template sees under those names (absent when `None`).
    pub fn new(
        origin: impl Into<String>,
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let origin = origin.into();
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&origin, "cannot configure Jinja", &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.into())
            .map_err(|e| template_error(&origin, "not a valid Jinja template", &e))?;
        Ok(ChatTemplate {
            env,
            origin,
            bos_token,
            eos_token,
        })
    }

    /// Where the template came from, as errors name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The text of `messages` in the model's format, followed by the start of an assistant turn
    /// when `add_generation_prompt`; an error names the template and what failed.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.origin, "cannot render", &e))?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().map(Value::from).unwrap_or(Value::UNDEFINED),
            eos_token => self.eos_token.as_deref().map(Value::from).unwrap_or(Value::UNDEFINED),
        };
        template
            .render(ctx)
            .map_err(|e| template_error(&self.origin, "cannot render", &e))
    }

    /// The byte range of each assistant turn in `whole` (the render of all `messages`), from the
    /// end of its header to the end of the last of `end_markers` in it ([`super::chat_sample`], guarantee 1).
    pub(super) fn assistant_spans(
        &self,
        messages: &[Message],
        whole: &str,
        end_markers: &[String],
    ) -> Result<Vec<Range<usize>>, TextError> {
        let mut spans = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if message.role != "assistant" {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let through = self.render(&messages[..=i], false)?;
            if !through.starts_with(&before) || !whole.starts_with(&through) {
                return Err(TextError::ChatTemplate {
                    origin: self.origin.clone(),
                    reason: format!(
                        "cannot find assistant message {i}: the renders of the conversation's \
                         first {i} messages (with the generation prompt) and first {} are not \
                         beginnings of the whole conversation's (the template renders earlier \
                         turns differently as the conversation grows)",
                        i + 1
                    ),
                });
            }
            let turn = &through[before.len()..];
            let end = end_markers
                .iter()
                .filter(|marker| !marker.is_empty())
                .filter_map(|marker| turn.rfind(marker.as_str()).map(|at| at + marker.len()))
                .max()
                .unwrap_or(turn.len());
            spans.push(before.len()..before.len() + end);
        }
        Ok(spans)
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// A minijinja error as [`TextError::ChatTemplate`], with what was being done and every cause.
fn template_error(origin: &str, doing: &str, error: &minijinja::Error) -> TextError {
    let mut reason = format!("{doing}: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        reason.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    TextError::ChatTemplate {
        origin: origin.to_string(),
        reason,
    }
}

/// Prints values as Python's Jinja2 does where minijinja differs: `True`, `False`, `None`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    let python = match value.kind() {
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        ValueKind::None => "None",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(python).map_err(minijinja::Error::from)
}

/// `raise_exception(message)`: the template's own error, carrying its message.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {message}"),
    ))
}

/// `strftime_now(format)`: the current time (UTC) in Python's `strftime` format.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, now).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// The proleptic Gregorian (year, month 1–12, day 1–31) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as usize, day)
}

/// `unix_seconds` (UTC) formatted by Python's `strftime` directives `%Y %y %m %d %e %j %B %b %h
/// %A %a %H %I %M %S %p %F %T %D %n %t %%`; another directive is an error naming it.
fn strftime(format: &str, unix_seconds: i64) -> Result<String, String> {
    let days = unix_seconds.div_euclid(86_400);
    let seconds = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (seconds / 3_600, seconds / 60 % 60, seconds % 60);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 4).rem_euclid(7) as usize;
    let year_day = (1..month).map(|m| days_in_month(year, m)).sum::<i64>() + day;
    let month_name = MONTHS[month - 1];
    let weekday_name = WEEKDAYS[weekday];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars
            .next()
            .ok_or_else(|| format!("strftime format {format:?} ends in a lone %"))?;
        let text = match directive {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:2}"),
            'j' => format!("{year_day:03}"),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name[..3].to_string(),
            'A' => weekday_name.to_string(),
            'a' => weekday_name[..3].to_string(),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'n' => "\n".to_string(),
            't' => "\t".to_string(),
            '%' => "%".to_string(),
            other => {
                return Err(format!(
                    "strftime directive %{other} (in {format:?}) is not supported"
                ))
            }
        };
        out.push_str(&text);
    }
    Ok(out)
}

/// The days of `month` (1–12) in `year`.
fn days_in_month(year: i64, month: usize) -> i64 {
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// `value | tojson(indent=None, ensure_ascii=False, sort_keys=False)`: Python's `json.dumps`, as
/// `transformers` defines the filter (`", "` and `": "` separators, `","` with an indent; no HTML
/// escaping).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, sort_keys.unwrap_or(false), 0)?;
    if ensure_ascii.unwrap_or(false) {
        out = out
            .chars()
            .flat_map(|c| {
                if c.is_ascii() {
                    vec![c.to_string()]
                } else {
                    let mut units = [0u16; 2];
                    c.encode_utf16(&mut units)
                        .iter()
                        .map(|unit| format!("\\u{unit:04x}"))
                        .collect()
                }
            })
            .collect();
    }
    Ok(Value::from_safe_string(out))
}

/// Appends `value` as Python's `json.dumps` writes it at nesting `depth`.
fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
) -> Result<(), minijinja::Error> {
    let unsupported = |kind: ValueKind| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: cannot write a {kind} as JSON"),
        )
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match value.as_i64() {
            Some(int) => out.push_str(&int.to_string()),
            None => {
                let float = f64::try_from(value.clone())?;
                out.push_str(&match float {
                    f if f.is_nan() => "NaN".to_string(),
                    f if f.is_infinite() && f > 0.0 => "Infinity".to_string(),
                    f if f.is_infinite() => "-Infinity".to_string(),
                    f => format!("{f:?}"),
                });
            }
        },
        ValueKind::String => out.push_str(&json_string(value.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_items(out, items.len(), indent, depth, '[', ']', |out, k| {
                write_json(out, &items[k], indent, sort_keys, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                let key = key.as_str().map_or_else(|| key.to_string(), str::to_string);
                entries.push((key, item));
            }
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_items(out, entries.len(), indent, depth, '{', '}', |out, k| {
                out.push_str(&json_string(&entries[k].0));
                out.push_str(": ");
                write_json(out, &entries[k].1, indent, sort_keys, depth + 1)
            })?;
        }
        other => return Err(unsupported(other)),
    }
    Ok(())
}

/// `n` items between `open` and `close`, each written by `item`, separated as `json.dumps` does.
fn write_items(
    out: &mut String,
    n: usize,
    indent: Option<usize>,
    depth: usize,
    open: char,
    close: char,
    mut item: impl FnMut(&mut String, usize) -> Result<(), minijinja::Error>,
) -> Result<(), minijinja::Error> {
    out.push(open);
    if n > 0 {
        for k in 0..n {
            match indent {
                Some(width) => {
                    out.push_str(if k == 0 { "\n" } else { ",\n" });
                    out.push_str(&" ".repeat(width * (depth + 1)));
                }
                None if k > 0 => out.push_str(", "),
                None => {}
            }
            item(out, k)?;
        }
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    }
    out.push(close);
    Ok(())
}

/// `text` as a JSON string (the escapes of Python's `json.dumps(ensure_ascii=False)`).
fn json_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizers::{chat_dir, ChatModel};
    use crate::{prompt_from_chat, HfTokenizer, Sample, Tokenizer};

    fn conversation() -> Vec<Message> {
        vec![
            Message::system("You are terse."),
            Message::user("What is 2 + 3?"),
            Message::assistant("2 + 3 = 5\n#### 5"),
        ]
    }

    fn multi_turn() -> Vec<Message> {
        vec![
            Message::user("Hi"),
            Message::assistant("Hello! How can I help?"),
            Message::user("Add 1 and 2."),
            Message::assistant("1 + 2 = 3"),
        ]
    }

    /// `render` with today's date (`strftime_now("%d %b %Y")`) replaced by `DATE`, rendering again
    /// if the date changed meanwhile.
    fn render_dated(t: &ChatTemplate, messages: &[Message], generation: bool) -> String {
        loop {
            let today = || strftime_now("%d %b %Y".into()).expect("a supported format");
            let before = today();
            let text = t.render(messages, generation).expect("renders");
            if today() == before {
                return text.replace(&format!("Today Date: {before}\n"), "Today Date: DATE\n");
            }
        }
    }

    const QWEN_DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are Qwen, created by Alibaba \
                                       Cloud. You are a helpful assistant.<|im_end|>\n";
    const LLAMA_SYSTEM: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
                                Cutting Knowledge Date: December 2023\nToday Date: DATE\n\n";

    #[test]
    fn rendered_as_transformers_renders_qwen2_5_chatml() {
        let dir = chat_dir("render-qwen", ChatModel::Qwen25);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        let template = t.chat_template().expect("Qwen2.5 has a chat template");
        // The strings below are what Jinja2, set up as `transformers` sets it up, renders from
        // the same template.
        assert_eq!(
            template.render(&conversation(), false).expect("renders"),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\
             <|im_end|>\n<|im_start|>assistant\n2 + 3 = 5\n#### 5<|im_end|>\n"
        );
        assert_eq!(
            template
                .render(&conversation()[..2], true)
                .expect("renders"),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\
             <|im_end|>\n<|im_start|>assistant\n"
        );
        // No system message: Qwen's default system prompt.
        assert_eq!(
            template.render(&multi_turn(), false).expect("renders"),
            format!(
                "{QWEN_DEFAULT_SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\
                 Hello! How can I help?<|im_end|>\n<|im_start|>user\nAdd 1 and 2.<|im_end|>\n\
                 <|im_start|>assistant\n1 + 2 = 3<|im_end|>\n"
            )
        );
    }

    #[test]
    fn rendered_as_transformers_renders_llama3_2_headers_date_and_eot() {
        let dir = chat_dir("render-llama", ChatModel::Llama32);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        let template = t.chat_template().expect("Llama 3.2 has a chat template");
        assert_eq!(
            render_dated(template, &conversation(), false),
            format!(
                "{LLAMA_SYSTEM}You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\
                 \n\nWhat is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n\
                 2 + 3 = 5\n#### 5<|eot_id|>"
            )
        );
        assert_eq!(
            render_dated(template, &multi_turn()[..3], true),
            format!(
                "{LLAMA_SYSTEM}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                 <|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>\
                 <|start_header_id|>user<|end_header_id|>\n\nAdd 1 and 2.<|eot_id|>\
                 <|start_header_id|>assistant<|end_header_id|>\n\n"
            )
        );
    }

    #[test]
    fn rendered_as_transformers_renders_python_methods_loop_controls_and_tojson() {
        let source = "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}\
                      {% endif %}[{{ m.role.upper() }}:{{ m.content.strip() }}]\
                      {% if loop.index == 4 %}{% break %}{% endif %}{% endfor %}\
                      |{{ messages[0] | tojson }}|{{ {'b': [1, 2.5, none, true], 'a': 'é\"'} \
                      | tojson(indent=2, sort_keys=true) }}|{{ 'é' | tojson(ensure_ascii=true) }}\
                      |{% if bos_token is defined %}B{% endif %}{{ eos_token }}\
                      |{{ 'a' is string }}{{ none }}{{ 1.0 }}{{ [1, 'b'] | length }}\
                      {% if tools is defined or documents is defined %}T{% endif %}";
        let t = ChatTemplate::new("test", source, None, Some("</s>".into())).expect("compiles");
        let messages = [
            Message::user("  a  "),
            Message::assistant("skip me"),
            Message::user("b"),
            Message::assistant("c"),
            Message::user("never"),
        ];
        // Python: json.dumps(x, ensure_ascii=False, indent=2, sort_keys=True).
        assert_eq!(
            t.render(&messages, false).expect("renders"),
            "[USER:a][USER:b][ASSISTANT:c]|{\"role\": \"user\", \"content\": \"  a  \"}|{\n  \
             \"a\": \"é\\\"\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}\
             |\"\\u00e9\"|</s>|TrueNone1.02"
        );
    }

    #[test]
    fn rendered_as_transformers_renders_strftime_in_utc() {
        let cases = [
            (
                0,
                "01 Jan 1970|1970-01-01 00:00:00|Thu Thursday January 001 70  1 12 AM %",
            ),
            (
                951_782_400,
                "29 Feb 2000|2000-02-29 00:00:00|Tue Tuesday February 060 00 29 12 AM %",
            ),
            (
                1_709_164_800,
                "29 Feb 2024|2024-02-29 00:00:00|Thu Thursday February 060 24 29 12 AM %",
            ),
            (
                -1,
                "31 Dec 1969|1969-12-31 23:59:59|Wed Wednesday December 365 69 31 11 PM %",
            ),
            (
                1_721_999_229,
                "26 Jul 2024|2024-07-26 13:07:09|Fri Friday July 208 24 26 01 PM %",
            ),
        ];
        // The expected strings are Python's `datetime.fromtimestamp(t, timezone.utc).strftime`.
        for (t, expected) in cases {
            let format = "%d %b %Y|%F %T|%a %A %B %j %y %e %I %p %%";
            assert_eq!(strftime(format, t).expect("supported"), expected, "{t}");
        }
        assert!(strftime("%Q", 0).expect_err("unsupported").contains("%Q"));
        assert!(strftime("100%", 0).expect_err("lone %").contains("lone %"));
    }

    #[test]
    fn errors_name_the_template_syntax_raise_exception_and_unknown_functions() {
        let err = ChatTemplate::new("bad.json", "{% for m in messages %}", None, None)
            .expect_err("unclosed for");
        assert!(matches!(&err, TextError::ChatTemplate { origin, .. } if origin == "bad.json"));
        assert!(
            err.to_string()
                .starts_with("chat template bad.json: not a valid Jinja template: "),
            "{err}"
        );

        let raising = "{% if messages[0].role != 'user' %}\
                       {{ raise_exception('Conversations must start with a user') }}{% endif %}";
        let t = ChatTemplate::new("strict", raising, None, None).expect("compiles");
        assert!(t.render(&[Message::user("hi")], false).is_ok());
        let err = t
            .render(&[Message::assistant("hi")], false)
            .expect_err("raises");
        let message = err.to_string();
        assert!(
            message.starts_with("chat template strict: cannot render: "),
            "{message}"
        );
        assert!(
            message.contains("raise_exception: Conversations must start with a user"),
            "{message}"
        );

        let t =
            ChatTemplate::new("calls", "{{ no_such_function() }}", None, None).expect("compiles");
        let err = t.render(&[], false).expect_err("unknown function");
        assert!(err
            .to_string()
            .starts_with("chat template calls: cannot render: "));
        let t =
            ChatTemplate::new("date", "{{ strftime_now('%Q') }}", None, None).expect("compiles");
        assert!(t
            .render(&[], false)
            .expect_err("bad directive")
            .to_string()
            .contains("%Q"));
    }

    /// The texts of `sample`'s tokens that carry loss, in order, each run of consecutive loss
    /// tokens decoded as one string (special tokens kept).
    fn loss_runs(t: &HfTokenizer, sample: &Sample) -> Vec<String> {
        let mut runs = Vec::new();
        let mut run: Vec<u32> = Vec::new();
        for (&id, &loss) in sample.tokens().iter().zip(sample.loss_mask()) {
            if loss {
                run.push(id);
            } else if !run.is_empty() {
                runs.push(t.decode_with_specials(&std::mem::take(&mut run)));
            }
        }
        if !run.is_empty() {
            runs.push(t.decode_with_specials(&run));
        }
        runs
    }

    #[test]
    fn loss_on_the_assistants_turns_end_of_turn_included_qwen2_5() {
        let dir = chat_dir("mask-qwen", ChatModel::Qwen25);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        let im_start = t.token_to_id("<|im_start|>").expect("in the vocabulary");
        let im_end = t.token_to_id("<|im_end|>").expect("in the vocabulary");
        assert_eq!((im_start, im_end), (151_644, 151_645));

        let messages = multi_turn();
        let s = Sample::from_chat(&t, &messages).expect("a sample");
        // The template's special tokens are single ids: one <|im_start|> per turn (the default
        // system prompt's included) and one <|im_end|> after each.
        let count = |id: u32| s.tokens().iter().filter(|&&x| x == id).count();
        assert_eq!((count(im_start), count(im_end)), (5, 5));
        let text = t.decode_with_specials(s.tokens());
        let rendered = t
            .chat_template()
            .expect("a template")
            .render(&messages, false);
        assert_eq!(text, rendered.expect("renders"));
        assert_eq!(
            loss_runs(&t, &s),
            ["Hello! How can I help?<|im_end|>", "1 + 2 = 3<|im_end|>"]
        );
        // Every <|im_end|> after an assistant's content carries loss; the headers never do.
        for (k, &id) in s.tokens().iter().enumerate() {
            if id == im_start {
                assert!(!s.loss_mask()[k], "token {k}: a header");
            }
        }
        assert_eq!(s.tokens().first(), Some(&im_start), "Qwen has no BOS");

        // With a system message and non-ASCII content: byte offsets, not char offsets.
        let messages = [
            Message::system("Réponds en français."),
            Message::user("Combien font 2 + 3 ?"),
            Message::assistant("2 + 3 = 5 — voilà ✓"),
        ];
        let s = Sample::from_chat(&t, &messages).expect("a sample");
        assert_eq!(loss_runs(&t, &s), ["2 + 3 = 5 — voilà ✓<|im_end|>"]);
    }

    #[test]
    fn loss_on_the_assistants_turns_end_of_turn_included_llama3_2() {
        let dir = chat_dir("mask-llama", ChatModel::Llama32);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        let messages = multi_turn();
        let s = Sample::from_chat(&t, &messages).expect("a sample");
        assert_eq!(
            s.tokens()[0],
            128_000,
            "the template's bos_token, once: <|begin_of_text|>"
        );
        assert_eq!(s.tokens().iter().filter(|&&id| id == 128_000).count(), 1);
        assert_eq!(
            s.tokens().iter().filter(|&&id| id == 128_009).count(),
            5,
            "<|eot_id|> after the system block and each of the four turns"
        );
        assert_eq!(
            loss_runs(&t, &s),
            ["Hello! How can I help?<|eot_id|>", "1 + 2 = 3<|eot_id|>"]
        );
    }

    /// The tokenizer of `model`'s test directory, read once.
    fn tokenizer(model: ChatModel) -> &'static HfTokenizer {
        static QWEN: std::sync::OnceLock<HfTokenizer> = std::sync::OnceLock::new();
        static LLAMA: std::sync::OnceLock<HfTokenizer> = std::sync::OnceLock::new();
        let cell = if model == ChatModel::Qwen25 {
            &QWEN
        } else {
            &LLAMA
        };
        cell.get_or_init(|| {
            let dir = chat_dir(&format!("{model:?}-once"), model);
            HfTokenizer::from_dir(&dir.0).expect("a model directory")
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any contents (that start with no whitespace, which a tokenizer may join to the header,
        /// and write no special token): each assistant turn's loss is its content and end-of-turn
        /// token, byte for byte.
        #[test]
        fn loss_on_the_assistants_turns_end_of_turn_included_for_any_contents(
            turns in proptest::collection::vec(("[^\\s<][^<]{0,30}", "[^\\s<][^<]{0,30}"), 1..4),
        ) {
            let messages: Vec<Message> = turns
                .iter()
                .flat_map(|(q, a)| [Message::user(q.as_str()), Message::assistant(a.as_str())])
                .collect();
            for (model, end) in [(ChatModel::Qwen25, "<|im_end|>"), (ChatModel::Llama32, "<|eot_id|>")] {
                let t = tokenizer(model);
                let s = Sample::from_chat(t, &messages).expect("a sample");
                // Llama's template trims each content.
                let trim = model == ChatModel::Llama32;
                let expected: Vec<String> = turns
                    .iter()
                    .map(|(_, a)| format!("{}{end}", if trim { a.trim() } else { a.as_str() }))
                    .collect();
                proptest::prop_assert_eq!(loss_runs(t, &s), expected);
            }
        }
    }

    #[test]
    fn loss_on_the_assistants_turns_of_gsm8k_problems_as_chat() {
        let dir = chat_dir("mask-gsm8k", ChatModel::Qwen25);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        for p in crate::ArithTask::train(5).problems(0..20) {
            let s = Sample::from_chat(&t, &p.messages()).expect("a sample");
            assert_eq!(loss_runs(&t, &s), [format!("{}<|im_end|>", p.answer)]);
            let prompt = prompt_from_chat(&t, &p.messages()[..1]).expect("a prompt");
            assert_eq!(
                &s.tokens()[..prompt.len()],
                &prompt[..],
                "the prompt starts the sample"
            );
            assert!(s.loss_mask()[..prompt.len()].iter().all(|&m| !m));
            assert_eq!(
                s.loss_tokens(),
                s.len() - prompt.len() - 1,
                "all but the last \\n"
            );
        }
    }

    #[test]
    fn prompts_for_generation_end_with_the_assistant_header() {
        let dir = chat_dir("prompt-qwen", ChatModel::Qwen25);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        let messages = [Message::user("What is 2 + 3?")];
        let prompt = prompt_from_chat(&t, &messages).expect("a prompt");
        assert_eq!(
            t.decode_with_specials(&prompt),
            format!(
                "{QWEN_DEFAULT_SYSTEM}<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n\
                 <|im_start|>assistant\n"
            )
        );
        let last = prompt
            .iter()
            .rposition(|&id| id == 151_644)
            .expect("<|im_start|>");
        assert_eq!(t.decode(&prompt[last..]).expect("decode"), "assistant\n");
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_is_an_error_naming_it() {
        // Like Qwen3's: earlier assistant turns lose their reasoning, the last keeps it.
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
                      {% if m.role == 'assistant' and not loop.last %}\
                      {{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}\
                      <|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new("rewriting", source, None, None).expect("compiles");
        let messages = [
            Message::user("a"),
            Message::assistant("<think>x</think>b"),
            Message::user("c"),
            Message::assistant("d"),
        ];
        let whole = t.render(&messages, false).expect("renders");
        let err = t
            .assistant_spans(&messages, &whole, &["<|im_end|>".into()])
            .expect_err("the first assistant turn is rendered differently at the end");
        assert!(matches!(&err, TextError::ChatTemplate { origin, .. } if origin == "rewriting"));
        assert!(
            err.to_string()
                .starts_with("chat template rewriting: cannot find assistant message 1: "),
            "{err}"
        );
    }

    #[test]
    fn errors_name_the_tokenizer_without_a_chat_template() {
        let dir = chat_dir("no-template", ChatModel::None);
        let t = HfTokenizer::from_dir(&dir.0).expect("a lone tokenizer.json");
        assert!(t.chat_template().is_none());
        let err = Sample::from_chat(&t, &multi_turn()).expect_err("no template");
        assert!(err.to_string().contains("no chat_template"), "{err}");
        assert!(prompt_from_chat(&t, &multi_turn()).is_err());
    }
}
