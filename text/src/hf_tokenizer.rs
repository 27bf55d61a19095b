//! A Hugging Face tokenizer (BPE, WordPiece, Unigram or WordLevel) as a [`Tokenizer`], through
//! the `tokenizers` crate (pure Rust: `fancy-regex`, no network): a model directory's
//! `tokenizer.json` with its `tokenizer_config.json` and `generation_config.json`
//! ([`HfTokenizer::from_dir`]), or a lone `tokenizer.json` ([`HfTokenizer::from_file`]).
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Errors name the file and field**: a missing or unreadable file is [`TextError::Open`]; a
//!    file that is not a valid `tokenizer.json`, or a configuration file that is not a JSON
//!    object, is [`TextError::Tokenizer`] naming it; a configuration field of the wrong type, a
//!    token it names that is not in the vocabulary, or an id outside the vocabulary, is
//!    [`TextError::ConfigField`] naming the file and the field; a `chat_template` that does not
//!    compile is [`TextError::ChatTemplate`] naming its file. Without an end-of-sequence token
//!    the error names the names tried.
//! 2. **Special ids as the model's files say**: `tokenizer_config.json`'s `bos_token`,
//!    `eos_token` and `pad_token` (a string, an `AddedToken` object `{"content": …}`, or null)
//!    come first, then `generation_config.json`'s `bos_token_id`, `eos_token_id` (its first id
//!    when a list) and `pad_token_id`, then the usual names ([`BOS_NAMES`], [`EOS_NAMES`],
//!    [`PAD_NAMES`]). BOS may be absent: a null `bos_token` means none (Qwen's), and
//!    `add_bos_token: false` means sequences do not start with it; PAD falls back to EOS. The
//!    stop ids are EOS and every id of `eos_token_id` (Llama 3.2: `<|eot_id|>`,
//!    `<|end_of_text|>`, `<|eom_id|>`; Qwen2.5: `<|im_end|>`, `<|endoftext|>`). A lone
//!    `tokenizer.json` goes by the names alone.
//! 3. **Every id is in the vocabulary**: [`Tokenizer::vocab_size`] is one past the largest id,
//!    added tokens included (the tokenizer's vocabulary size when ids are contiguous), so a model
//!    of that many ids embeds every id `encode` emits.
//! 4. **Decode skips what is not text**: BOS, EOS, PAD, the stop ids, every token the file marks
//!    special and every id at or past the vocabulary size are dropped; the rest goes through the
//!    file's decoder (a GPT-2-style byte-level BPE round-trips any text exactly, newlines
//!    included).
//! 5. **The model's own chat template**: [`HfTokenizer::chat_template`] is `chat_template.jinja`
//!    when the directory has one, else `tokenizer_config.json`'s `chat_template` (a string, or the
//!    one named `default` of a list), seeing the BOS and EOS texts as `bos_token` and
//!    `eos_token` (see [`super::chat`]).
//!
//! Encoding never adds special tokens (no post-processor BOS) and never truncates or pads, even
//! when `tokenizer.json` asks to; special tokens written in the text (`<|im_start|>`) become their
//! single ids. Errors of encoding and decoding are [`TextError::Tokenizer`] naming the file.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::chat::ChatTemplate;
use super::jsonl::kind;
use super::tokenizer::Tokenizer;
use super::TextError;

/// End-of-sequence names tried, in order (GPT-2 and Qwen, Llama 2 and Mistral, Gemma, ChatML,
/// Llama 3, BERT).
pub const EOS_NAMES: [&str; 6] = [
    "<|endoftext|>",
    "</s>",
    "<eos>",
    "<|im_end|>",
    "<|end_of_text|>",
    "[SEP]",
];
/// Beginning-of-sequence names tried, in order; without one, there is no BOS.
pub const BOS_NAMES: [&str; 4] = ["<s>", "<bos>", "<|begin_of_text|>", "[CLS]"];
/// Padding names tried, in order; without one, PAD is EOS.
pub const PAD_NAMES: [&str; 3] = ["<pad>", "[PAD]", "<|pad|>"];

/// A model's tokenizer, read from its Hugging Face files.
///
/// ```no_run
/// use odc_text::{HfTokenizer, Message, Sample, Tokenizer};
/// let t = HfTokenizer::from_dir("Qwen2.5-0.5B-Instruct".as_ref())?;
/// let ids = t.encode("Lena buys 3 apples.")?;
/// println!("{} ids of {}; EOS {}, stop at {:?}", ids.len(), t.vocab_size(), t.eos(), t.stop_ids());
/// let chat = [Message::user("2 + 3?"), Message::assistant("5")];
/// let sample = Sample::from_chat(&t, &chat)?;
/// # Ok::<(), odc_text::TextError>(())
/// ```
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    bos: Option<u32>,
    eos: u32,
    pad: u32,
    stop_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

/// A special token as `tokenizer_config.json` gives it: absent, null, or present.
type Field<T> = Option<Option<T>>;

/// What `tokenizer_config.json` says about special tokens and chat.
#[derive(Default)]
struct TokenizerConfig {
    path: PathBuf,
    bos_token: Field<String>,
    eos_token: Field<String>,
    pad_token: Field<String>,
    add_bos_token: Option<bool>,
    chat_template: Option<String>,
}

/// What `generation_config.json` says about special ids (null is as absent).
#[derive(Default)]
struct GenerationConfig {
    path: PathBuf,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    pad_token_id: Option<u32>,
}

impl HfTokenizer {
    /// Reads a lone `tokenizer.json` at `path`; special ids by name (guarantees 1–3), no chat
    /// template.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        Self::build(load(path)?, path, None, None, None)
    }

    /// Reads the model directory `dir`: `tokenizer.json` (required), `tokenizer_config.json`,
    /// `generation_config.json` and `chat_template.jinja` (each optional), as guarantees 1–5 say.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer.json");
        let inner = load(&path)?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_object(&config_path)?
            .map(|object| TokenizerConfig::parse(config_path, &object))
            .transpose()?;
        let generation_path = dir.join("generation_config.json");
        let generation = read_object(&generation_path)?
            .map(|object| GenerationConfig::parse(generation_path, &object))
            .transpose()?;
        let jinja = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja) {
            Ok(source) => Some((jinja.display().to_string(), source)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(TextError::Open {
                    path: jinja,
                    source,
                })
            }
        };
        Self::build(inner, &path, config, generation, template)
    }

    /// Resolves the special ids and the template (guarantees 2, 3 and 5).
    fn build(
        inner: tokenizers::Tokenizer,
        path: &Path,
        config: Option<TokenizerConfig>,
        generation: Option<GenerationConfig>,
        template_file: Option<(String, String)>,
    ) -> Result<Self, TextError> {
        let config = config.unwrap_or_default();
        let generation = generation.unwrap_or_default();
        let largest = inner.get_vocab(true).into_values().max().unwrap_or(0);
        let vocab_size = inner.get_vocab_size(true).max(largest as usize + 1);
        // A token a configuration file names, as an id of this vocabulary.
        let named =
            |field: &str, token: &Field<String>| -> Result<Field<u32>, TextError> {
                match token {
                    Some(Some(name)) => inner
                        .token_to_id(name)
                        .map(|id| Some(Some(id)))
                        .ok_or_else(|| {
                            field_error(&config.path, field, format!("{name:?} {}", absent(path)))
                        }),
                    Some(None) => Ok(Some(None)),
                    None => Ok(None),
                }
            };
        for (field, ids) in [
            ("bos_token_id", Vec::from_iter(generation.bos_token_id)),
            ("eos_token_id", generation.eos_token_ids.clone()),
            ("pad_token_id", Vec::from_iter(generation.pad_token_id)),
        ] {
            if let Some(id) = ids.into_iter().find(|&id| inner.id_to_token(id).is_none()) {
                let reason = format!("id {id} {}", absent(path));
                return Err(field_error(&generation.path, field, reason));
            }
        }
        let by_name = |names: &[&str]| names.iter().find_map(|name| inner.token_to_id(name));
        // Each: `tokenizer_config.json`'s token, else `generation_config.json`'s id, else the
        // usual names; only a null `bos_token` says "none" (Qwen's), where the others go on.
        let eos = named("eos_token", &config.eos_token)?
            .flatten()
            .or(generation.eos_token_ids.first().copied())
            .or_else(|| by_name(&EOS_NAMES))
            .ok_or_else(|| TextError::Tokenizer {
                path: path.to_path_buf(),
                reason: format!(
                    "no end-of-sequence token: none of {} is in its vocabulary",
                    EOS_NAMES.join(" ")
                ),
            })?;
        let bos_token = named("bos_token", &config.bos_token)?
            .unwrap_or_else(|| generation.bos_token_id.or_else(|| by_name(&BOS_NAMES)));
        let bos = bos_token.filter(|_| config.add_bos_token != Some(false));
        let pad = named("pad_token", &config.pad_token)?
            .flatten()
            .or(generation.pad_token_id)
            .or_else(|| by_name(&PAD_NAMES))
            .unwrap_or(eos);
        let mut stop_ids = vec![eos];
        for &id in &generation.eos_token_ids {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        let template_source = template_file.or_else(|| {
            let origin = config.path.display().to_string();
            config.chat_template.clone().map(|source| (origin, source))
        });
        let chat_template = match template_source {
            Some((origin, source)) => {
                let text = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id));
                Some(ChatTemplate::new(
                    origin,
                    source,
                    text(bos_token),
                    text(Some(eos)),
                )?)
            }
            None => None,
        };
        Ok(HfTokenizer {
            inner,
            path: path.to_path_buf(),
            vocab_size,
            bos,
            eos,
            pad,
            stop_ids,
            chat_template,
        })
    }

    /// The model's chat template, if its files have one (guarantee 5).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The id of the token `token` (a special token's text, such as `<|im_end|>`, or a piece of
    /// the vocabulary), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The `tokenizer.json` this tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The chat template, or an error naming the tokenizer's file when it has none.
    pub(crate) fn require_chat_template(&self) -> Result<&ChatTemplate, TextError> {
        self.chat_template.as_ref().ok_or_else(|| {
            self.error(
                "no chat_template: neither tokenizer_config.json nor chat_template.jinja beside \
                 it has one"
                    .into(),
            )
        })
    }

    /// The texts of the stop ids, which end a turn in a rendered chat.
    pub(crate) fn stop_texts(&self) -> Vec<String> {
        self.stop_ids
            .iter()
            .filter_map(|&id| self.inner.id_to_token(id))
            .collect()
    }

    /// The encoding of `text`: its ids and each one's byte range in it (`get_offsets`); special
    /// tokens in the text become their ids, none is added.
    pub(crate) fn encode_text(&self, text: &str) -> Result<tokenizers::Encoding, TextError> {
        let encoding = self.inner.encode(text, false).map_err(|e| {
            let head: String = text.chars().take(40).collect();
            let more = if head.len() < text.len() { "…" } else { "" };
            self.error(format!("cannot encode {head:?}{more}: {e}"))
        })?;
        Ok(encoding)
    }

    /// `ids` decoded with every special token kept, for tests that read what a sample holds.
    #[cfg(test)]
    pub(crate) fn decode_with_specials(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).expect("decodable ids")
    }

    fn error(&self, reason: String) -> TextError {
        TextError::Tokenizer {
            path: self.path.clone(),
            reason,
        }
    }
}

/// The `tokenizer.json` at `path`, set to never truncate or pad.
fn load(path: &Path) -> Result<tokenizers::Tokenizer, TextError> {
    let bytes = std::fs::read(path).map_err(|source| TextError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let error = |reason: String| TextError::Tokenizer {
        path: path.to_path_buf(),
        reason,
    };
    let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| error(format!("not a valid tokenizer.json: {e}")))?;
    inner
        .with_truncation(None)
        .map_err(|e| error(format!("cannot turn truncation off: {e}")))?;
    inner.with_padding(None);
    Ok(inner)
}

/// "is not in the vocabulary of `tokenizer`".
fn absent(tokenizer: &Path) -> String {
    format!("is not in the vocabulary of {}", tokenizer.display())
}

fn field_error(path: &Path, field: &str, reason: String) -> TextError {
    TextError::ConfigField {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    }
}

/// The JSON object in the optional file `path`: `None` when there is no such file.
fn read_object(path: &Path) -> Result<Option<Map<String, Value>>, TextError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Open {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let error = |reason: String| TextError::Tokenizer {
        path: path.to_path_buf(),
        reason,
    };
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(object)) => Ok(Some(object)),
        Ok(other) => Err(error(format!(
            "expected a JSON object, got {}",
            kind(&other)
        ))),
        Err(e) => Err(error(format!("not valid JSON: {e}"))),
    }
}

impl TokenizerConfig {
    fn parse(path: PathBuf, object: &Map<String, Value>) -> Result<Self, TextError> {
        let error = |field: &str, reason: String| field_error(&path, field, reason);
        let token = |field: &str| -> Result<Field<String>, TextError> {
            match object.get(field) {
                None => Ok(None),
                Some(Value::Null) => Ok(Some(None)),
                Some(Value::String(name)) => Ok(Some(Some(name.clone()))),
                Some(Value::Object(added)) => match added.get("content") {
                    Some(Value::String(name)) => Ok(Some(Some(name.clone()))),
                    other => Err(error(
                        field,
                        format!(
                            "an AddedToken object needs a string \"content\", got {}",
                            other.map_or("none", kind)
                        ),
                    )),
                },
                Some(other) => Err(error(
                    field,
                    format!(
                        "expected a token (a string, an object with \"content\", or null), got {}",
                        kind(other)
                    ),
                )),
            }
        };
        let add_bos_token = match object.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(add)) => Some(*add),
            Some(other) => {
                let reason = format!("expected a boolean, got {}", kind(other));
                return Err(error("add_bos_token", reason));
            }
        };
        let chat_template = match object.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(source)) => Some(source.clone()),
            Some(Value::Array(named)) => {
                Some(default_template(named).map_err(|reason| error("chat_template", reason))?)
            }
            Some(other) => {
                let reason = format!(
                    "expected a template or a list of {{\"name\", \"template\"}} objects, got {}",
                    kind(other)
                );
                return Err(error("chat_template", reason));
            }
        };
        Ok(TokenizerConfig {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            pad_token: token("pad_token")?,
            add_bos_token,
            chat_template,
            path,
        })
    }
}

/// The template named `default` of a list of `{"name", "template"}` objects.
fn default_template(named: &[Value]) -> Result<String, String> {
    let mut names = Vec::new();
    for (i, entry) in named.iter().enumerate() {
        let field = |name: &str| match entry.get(name) {
            Some(Value::String(s)) => Ok(s.as_str()),
            other => Err(format!(
                "entry {i} needs a string \"{name}\", got {}",
                other.map_or("none", kind)
            )),
        };
        let name = field("name")?;
        let template = field("template")?;
        if name == "default" {
            return Ok(template.to_string());
        }
        names.push(format!("{name:?}"));
    }
    Err(format!(
        "no template named \"default\" among [{}]",
        names.join(", ")
    ))
}

impl GenerationConfig {
    fn parse(path: PathBuf, object: &Map<String, Value>) -> Result<Self, TextError> {
        let error = |field: &str, what: &Value| {
            let reason = format!("expected a token id (a non-negative integer), got {what}");
            field_error(&path, field, reason)
        };
        let id = |field: &str, value: &Value| -> Result<u32, TextError> {
            value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| error(field, value))
        };
        let optional_id = |field: &str| -> Result<Option<u32>, TextError> {
            match object.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => Ok(Some(id(field, value)?)),
            }
        };
        let eos_token_ids = match object.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|value| id("eos_token_id", value))
                .collect::<Result<_, _>>()?,
            Some(value) => vec![id("eos_token_id", value)?],
        };
        Ok(GenerationConfig {
            bos_token_id: optional_id("bos_token_id")?,
            pad_token_id: optional_id("pad_token_id")?,
            eos_token_ids,
            path,
        })
    }
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("stop_ids", &self.stop_ids)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        Ok(self.encode_text(text)?.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        let text: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| {
                (id as usize) < self.vocab_size
                    && Some(id) != self.bos
                    && id != self.pad
                    && !self.stop_ids.contains(&id)
            })
            .collect();
        self.inner
            .decode(&text, true)
            .map_err(|e| self.error(format!("cannot decode {} ids: {e}", ids.len())))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn bos(&self) -> Option<u32> {
        self.bos
    }

    fn eos(&self) -> u32 {
        self.eos
    }

    fn stop_ids(&self) -> Vec<u32> {
        self.stop_ids.clone()
    }

    fn pad(&self) -> u32 {
        self.pad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tokenizers::{chat_dir, fixture, ChatModel, TempDir};
    use crate::{prompt_tokens, ArithTask, Problem, Sample};
    use tokenizers::models::wordlevel::{WordLevel, WordLevelTrainer};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::AddedToken;

    fn problems() -> Vec<Problem> {
        ArithTask::train(3).problems(0..40).collect()
    }

    /// A word-level tokenizer (whitespace-split words of `problems`, `[UNK]` for the rest) with
    /// `specials` added as special tokens, saved as `dir/tokenizer.json`.
    fn save_word_level(dir: &Path, problems: &[Problem], specials: &[&str]) -> PathBuf {
        let model = WordLevel::builder()
            .unk_token("[UNK]".into())
            .build()
            .expect("word-level model");
        let mut tokenizer = tokenizers::Tokenizer::new(model);
        tokenizer.with_pre_tokenizer(Some(WhitespaceSplit));
        let special_tokens = std::iter::once("[UNK]")
            .chain(specials.iter().copied())
            .map(|name| AddedToken::from(name, true))
            .collect();
        let mut trainer: TrainerWrapper = WordLevelTrainer::builder()
            .show_progress(false)
            .special_tokens(special_tokens)
            .build()
            .expect("word-level trainer")
            .into();
        train_and_save(tokenizer, &mut trainer, problems, dir)
    }

    /// Trains `tokenizer` on the questions and answers of `problems` and saves it as
    /// `dir/tokenizer.json`.
    fn train_and_save(
        mut tokenizer: tokenizers::Tokenizer,
        trainer: &mut TrainerWrapper,
        problems: &[Problem],
        dir: &Path,
    ) -> PathBuf {
        let texts = problems
            .iter()
            .flat_map(|p| [p.question.clone(), p.answer.clone()]);
        tokenizer
            .train(trainer, texts)
            .expect("train the tokenizer");
        let path = dir.join("tokenizer.json");
        tokenizer.save(&path, false).expect("save the tokenizer");
        path
    }

    #[test]
    fn decode_skips_what_is_not_text_and_a_byte_level_bpe_round_trips_exactly() {
        use tokenizers::models::bpe::{BpeTrainer, BPE};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;

        let dir = TempDir::new("byte-level-bpe");
        let problems = problems();
        let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
        // GPT-2's settings: no space prepended, so a text decodes to exactly itself.
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .show_progress(false)
            .vocab_size(600)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
            .build()
            .into();
        let path = train_and_save(tokenizer, &mut trainer, &problems, &dir.0);

        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        assert_eq!(
            (t.bos(), t.pad()),
            (None, t.eos()),
            "GPT-2 style specials: no BOS by name, PAD is EOS"
        );
        for p in &problems {
            let mut ids = prompt_tokens(&t, &p.question).expect("encode");
            ids.extend(t.encode(&p.answer).expect("encode"));
            ids.extend([t.eos(), t.vocab_size() as u32]);
            let text = format!("{}\n{}", p.question, p.answer);
            assert_eq!(t.decode(&ids).expect("decode"), text);
        }
        let unseen = "Ünïcode ✓ and 12,345.6\n#### -7";
        let ids = t.encode(unseen).expect("bytes always encode");
        assert_eq!(t.decode(&ids).expect("decode"), unseen);
    }

    fn words(text: &str) -> String {
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn special_ids_found_by_name_and_every_id_is_in_the_vocabulary() {
        let dir = TempDir::new("specials");
        let path = save_word_level(&dir.0, &problems(), &["<s>", "</s>", "<pad>"]);
        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        let raw = tokenizers::Tokenizer::from_file(&path).expect("the same file");
        assert_eq!(t.bos(), raw.token_to_id("<s>"));
        assert_eq!(Some(t.eos()), raw.token_to_id("</s>"));
        assert_eq!(Some(t.pad()), raw.token_to_id("<pad>"));
        assert_eq!(t.vocab_size(), raw.get_vocab_size(true));
        assert!(t.vocab_size() > 100, "{}", t.vocab_size());
        for p in problems() {
            let ids = t.encode(&p.question).expect("encode");
            assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
        }

        // Only an EOS: no BOS, and PAD falls back to it.
        let only_eos = TempDir::new("only-eos");
        let path = save_word_level(&only_eos.0, &problems(), &["<|endoftext|>"]);
        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        assert_eq!(t.bos(), None);
        assert_eq!(t.pad(), t.eos());
        assert_eq!(t.stop_ids(), [t.eos()]);
        assert!(t.chat_template().is_none());
    }

    #[test]
    fn decode_skips_what_is_not_text_and_round_trips_the_words() {
        let dir = TempDir::new("round-trip");
        let problems = problems();
        let path = save_word_level(&dir.0, &problems, &["<s>", "</s>", "<pad>"]);
        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        for p in &problems {
            for text in [&p.question, &p.answer] {
                let ids = t.encode(text).expect("encode");
                assert_eq!(ids.len(), text.split_whitespace().count(), "{text:?}");
                let mut framed: Vec<u32> = t.bos().into_iter().collect();
                framed.extend(&ids);
                framed.extend([t.eos(), t.pad(), t.vocab_size() as u32, u32::MAX]);
                assert_eq!(t.decode(&framed).expect("decode"), words(text));
            }
        }
        // A word it never saw is `[UNK]`, special, so decoding drops it.
        let ids = t.encode("zyzzyva 7").expect("encode");
        assert_eq!(ids.len(), 2);
        assert_eq!(t.decode(&ids).expect("decode"), "7");
    }

    #[test]
    fn prompt_masked_with_an_hf_tokenizer() {
        let dir = TempDir::new("sample");
        let problems = problems();
        let path = save_word_level(&dir.0, &problems, &["<s>", "</s>", "<pad>"]);
        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        for p in &problems {
            let s = Sample::from_problem(&t, p).expect("tokenize");
            let prompt = prompt_tokens(&t, &p.question).expect("tokenize");
            let answer = t.encode(&p.answer).expect("encode");
            assert_eq!(Some(prompt[0]), t.bos());
            assert_eq!(&s.tokens()[..prompt.len()], &prompt[..]);
            assert_eq!(&s.tokens()[prompt.len()..s.len() - 1], &answer[..]);
            assert_eq!(s.tokens()[s.len() - 1], t.eos());
            assert!(s.loss_mask()[..prompt.len()].iter().all(|&m| !m));
            assert_eq!(s.loss_tokens(), answer.len() + 1);
        }
    }

    #[test]
    fn errors_name_the_file_missing_garbage_and_no_eos() {
        let dir = TempDir::new("errors");

        let missing = dir.0.join("absent.json");
        let err = HfTokenizer::from_file(&missing).expect_err("no such file");
        assert!(matches!(&err, TextError::Open { source, .. }
            if source.kind() == std::io::ErrorKind::NotFound));
        assert_eq!(
            err.to_string(),
            format!("cannot open {}", missing.display())
        );

        let good = save_word_level(&dir.0, &problems(), &["</s>"]);
        let text = std::fs::read_to_string(&good).expect("saved");
        let truncated = dir.0.join("truncated.json");
        std::fs::write(&truncated, &text[..text.len() / 2]).expect("write");
        let garbage = dir.0.join("garbage.json");
        std::fs::write(&garbage, "{\"model\": 7}").expect("write");
        for path in [&truncated, &garbage] {
            let err = HfTokenizer::from_file(path).expect_err("not a tokenizer.json");
            let message = err.to_string();
            assert!(
                message.starts_with(&format!(
                    "tokenizer {}: not a valid tokenizer.json: ",
                    path.display()
                )),
                "{message}"
            );
        }

        let no_eos_dir = TempDir::new("no-eos");
        let no_eos = save_word_level(&no_eos_dir.0, &problems(), &["<s>", "<pad>"]);
        let err = HfTokenizer::from_file(&no_eos).expect_err("no EOS");
        assert_eq!(
            err.to_string(),
            format!(
                "tokenizer {}: no end-of-sequence token: none of <|endoftext|> </s> <eos> \
                 <|im_end|> <|end_of_text|> [SEP] is in its vocabulary",
                no_eos.display()
            )
        );
    }

    #[test]
    fn errors_name_the_file_when_encoding_fails() {
        let dir = TempDir::new("encode-error");
        let path = save_word_level(&dir.0, &problems(), &["</s>"]);
        // The same tokenizer with an unknown-word token that is not in its vocabulary.
        let text = std::fs::read_to_string(&path).expect("saved");
        let broken = text.replace("\"unk_token\":\"[UNK]\"", "\"unk_token\":\"<nowhere>\"");
        assert_ne!(broken, text, "the saved file names its unk_token");
        std::fs::write(&path, broken).expect("write");
        let t = HfTokenizer::from_file(&path).expect("loads");
        let err = t.encode("zyzzyva").expect_err("no unknown-word token");
        assert!(
            err.to_string().starts_with(&format!(
                "tokenizer {}: cannot encode \"zyzzyva\": ",
                path.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn special_ids_as_the_model_files_say_qwen2_5() {
        let dir = chat_dir("qwen-ids", ChatModel::Qwen25);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        // bos_token null (though generation_config has a bos_token_id), EOS <|im_end|>,
        // PAD <|endoftext|>, stop at both.
        assert_eq!(t.bos(), None);
        assert_eq!((t.eos(), t.pad()), (151_645, 151_643));
        assert_eq!(t.stop_ids(), [151_645, 151_643]);
        assert_eq!(t.vocab_size(), 151_646, "one past the largest id");
        assert_eq!(
            t.chat_template().map(ChatTemplate::origin),
            Some(
                dir.0
                    .join("tokenizer_config.json")
                    .display()
                    .to_string()
                    .as_str()
            )
        );
        let prompt = prompt_tokens(&t, "What is 2 + 3?").expect("encode");
        assert_eq!(
            prompt,
            t.encode("What is 2 + 3?\n").expect("encode"),
            "no BOS"
        );
        let framed: Vec<u32> = [151_644]
            .into_iter()
            .chain(prompt)
            .chain([151_645, 151_643])
            .collect();
        assert_eq!(t.decode(&framed).expect("decode"), "What is 2 + 3?\n");
    }

    #[test]
    fn special_ids_as_the_model_files_say_llama3_2() {
        let dir = chat_dir("llama-ids", ChatModel::Llama32);
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        assert_eq!(t.bos(), Some(128_000), "<|begin_of_text|>");
        assert_eq!(t.eos(), 128_009, "<|eot_id|>");
        assert_eq!(t.pad(), t.eos(), "no pad_token: EOS");
        assert_eq!(
            t.stop_ids(),
            [128_009, 128_001, 128_008],
            "<|eot_id|>, <|end_of_text|>, <|eom_id|>"
        );
        let s = Sample::from_problem(&t, &problems()[0]).expect("encode");
        assert_eq!(s.tokens()[0], 128_000);
        assert_eq!(s.tokens()[s.len() - 1], 128_009);
    }

    #[test]
    fn special_ids_as_the_model_files_say_with_fallbacks_and_every_form() {
        // tokenizer.json alone: the usual names.
        let dir = chat_dir("bare-ids", ChatModel::None);
        let t = HfTokenizer::from_dir(&dir.0).expect("a lone tokenizer.json");
        assert_eq!(
            (t.bos(), t.eos(), t.pad()),
            (Some(128_000), 151_643, 151_643)
        );
        assert_eq!(t.stop_ids(), [151_643]);
        assert!(t.chat_template().is_none());

        // An AddedToken object, add_bos_token false, a null pad_token (the generation config's
        // then), a list of named templates, one id for eos_token_id.
        dir.write(
            "tokenizer_config.json",
            r#"{"bos_token": "<|begin_of_text|>", "add_bos_token": false, "pad_token": null,
                "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": true},
                "chat_template": [{"name": "tool_use", "template": "tools"},
                                  {"name": "default", "template": "[{{ bos_token }}|{{ eos_token }}]"}]}"#,
        );
        dir.write(
            "generation_config.json",
            r#"{"bos_token_id": null, "eos_token_id": 128001, "pad_token_id": 128008}"#,
        );
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        assert_eq!((t.bos(), t.eos(), t.pad()), (None, 128_009, 128_008));
        assert_eq!(t.stop_ids(), [128_009, 128_001]);
        let template = t.chat_template().expect("the default one");
        assert_eq!(
            template.render(&[], false).expect("renders"),
            "[<|begin_of_text|>|<|eot_id|>]",
            "the template still sees the BOS text"
        );

        // generation_config alone names EOS and BOS; chat_template.jinja is the template.
        std::fs::remove_file(dir.0.join("tokenizer_config.json")).expect("remove");
        dir.write(
            "generation_config.json",
            r#"{"bos_token_id": 128000, "eos_token_id": [128009, 128001]}"#,
        );
        let jinja = dir.write(
            "chat_template.jinja",
            "{{ bos_token }}{{ messages | length }}",
        );
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        assert_eq!(
            (t.bos(), t.eos(), t.pad()),
            (Some(128_000), 128_009, 128_009)
        );
        assert_eq!(t.stop_ids(), [128_009, 128_001]);
        let template = t.chat_template().expect("chat_template.jinja");
        assert_eq!(template.origin(), jinja.display().to_string());
        assert_eq!(
            template.render(&[], false).expect("renders"),
            "<|begin_of_text|>0"
        );

        // chat_template.jinja wins over tokenizer_config.json's.
        std::fs::copy(
            fixture("qwen2.5", "tokenizer_config.json"),
            dir.0.join("tokenizer_config.json"),
        )
        .expect("copy");
        let t = HfTokenizer::from_dir(&dir.0).expect("a model directory");
        assert_eq!(
            t.chat_template()
                .expect("a template")
                .render(&[], false)
                .expect("renders"),
            "0"
        );
    }

    #[test]
    fn errors_name_the_file_and_field_of_every_bad_configuration() {
        let tokenizer_config = "tokenizer_config.json";
        let generation_config = "generation_config.json";
        let cases: [(&str, &str, &str); 16] = [
            (tokenizer_config, "{\"eos_token\": ", "tokenizer {}: not valid JSON: "),
            (tokenizer_config, "[1]", "tokenizer {}: expected a JSON object, got an array"),
            (generation_config, "7", "tokenizer {}: expected a JSON object, got a number"),
            (
                tokenizer_config,
                r#"{"eos_token": "<|nowhere|>"}"#,
                "{}: field \"eos_token\": \"<|nowhere|>\" is not in the vocabulary of ",
            ),
            (
                tokenizer_config,
                r#"{"bos_token": 7}"#,
                "{}: field \"bos_token\": expected a token (a string, an object with \"content\", \
                 or null), got a number",
            ),
            (
                tokenizer_config,
                r#"{"pad_token": {"id": 3}}"#,
                "{}: field \"pad_token\": an AddedToken object needs a string \"content\", got none",
            ),
            (
                tokenizer_config,
                r#"{"chat_template": 3}"#,
                "{}: field \"chat_template\": expected a template or a list of {\"name\", \
                 \"template\"} objects, got a number",
            ),
            (
                tokenizer_config,
                r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#,
                "{}: field \"chat_template\": no template named \"default\" among [\"tool_use\"]",
            ),
            (
                tokenizer_config,
                r#"{"chat_template": [{"name": "default"}]}"#,
                "{}: field \"chat_template\": entry 0 needs a string \"template\", got none",
            ),
            (
                tokenizer_config,
                r#"{"add_bos_token": "yes"}"#,
                "{}: field \"add_bos_token\": expected a boolean, got a string",
            ),
            (
                tokenizer_config,
                r#"{"chat_template": "{% if %}"}"#,
                "chat template {}: not a valid Jinja template: ",
            ),
            (
                generation_config,
                r#"{"eos_token_id": "x"}"#,
                "{}: field \"eos_token_id\": expected a token id (a non-negative integer), got \"x\"",
            ),
            (
                generation_config,
                r#"{"eos_token_id": [128009, 1.5]}"#,
                "{}: field \"eos_token_id\": expected a token id (a non-negative integer), got 1.5",
            ),
            (
                generation_config,
                r#"{"pad_token_id": -1}"#,
                "{}: field \"pad_token_id\": expected a token id (a non-negative integer), got -1",
            ),
            (
                generation_config,
                r#"{"eos_token_id": [128009, 5000]}"#,
                "{}: field \"eos_token_id\": id 5000 is not in the vocabulary of ",
            ),
            (
                generation_config,
                r#"{"bos_token_id": 151646}"#,
                "{}: field \"bos_token_id\": id 151646 is not in the vocabulary of ",
            ),
        ];
        for (i, (file, text, expected)) in cases.into_iter().enumerate() {
            let dir = chat_dir(&format!("bad-config-{i}"), ChatModel::None);
            let path = dir.write(file, text);
            let err = HfTokenizer::from_dir(&dir.0).expect_err("a bad configuration");
            let expected = expected.replace("{}", &path.display().to_string());
            let message = err.to_string();
            assert!(
                message.starts_with(&expected),
                "{message:?} should start with {expected:?}"
            );
            if expected.ends_with("vocabulary of ") {
                assert!(message.ends_with(&format!("{}", dir.0.join("tokenizer.json").display())));
            }
        }

        let dir = TempDir::new("no-tokenizer-json");
        dir.write(tokenizer_config, "{}");
        let err = HfTokenizer::from_dir(&dir.0).expect_err("no tokenizer.json");
        assert!(
            matches!(&err, TextError::Open { path, .. } if path == &dir.0.join("tokenizer.json"))
        );
    }
}
