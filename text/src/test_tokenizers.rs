//! Test-only model directories: a small byte-level BPE `tokenizer.json` whose chat special tokens
//! sit at the real models' ids, beside the real `tokenizer_config.json` and
//! `generation_config.json` of `tests/fixtures/chat/` (see its README).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::ArithTask;

/// The chat special tokens at their ids in Qwen2.5's and Llama 3's vocabularies.
pub(crate) const CHAT_SPECIALS: [(&str, u32); 9] = [
    ("<|begin_of_text|>", 128_000),
    ("<|end_of_text|>", 128_001),
    ("<|start_header_id|>", 128_006),
    ("<|end_header_id|>", 128_007),
    ("<|eom_id|>", 128_008),
    ("<|eot_id|>", 128_009),
    ("<|endoftext|>", 151_643),
    ("<|im_start|>", 151_644),
    ("<|im_end|>", 151_645),
];

/// A directory of its own under the system's temp dir, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> Self {
        let dir = crate::test_util::temp_path("odc-text", name);
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        TempDir(dir)
    }

    /// Writes `text` to the file `name` in this directory.
    pub(crate) fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write a test file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whose configuration files a test directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChatModel {
    /// `tests/fixtures/chat/qwen2.5/`.
    Qwen25,
    /// `tests/fixtures/chat/llama3.2/`.
    Llama32,
    /// No configuration file: `tokenizer.json` alone.
    None,
}

/// The fixture file `file` of `model` (`qwen2.5` or `llama3.2`).
pub(crate) fn fixture(model: &str, file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/chat")
        .join(model)
        .join(file)
}

/// A model directory named after `name`: the chat BPE `tokenizer.json` and `model`'s
/// configuration files.
pub(crate) fn chat_dir(name: &str, model: ChatModel) -> TempDir {
    let dir = TempDir::new(name);
    dir.write("tokenizer.json", chat_tokenizer_json());
    let fixtures = match model {
        ChatModel::Qwen25 => Some("qwen2.5"),
        ChatModel::Llama32 => Some("llama3.2"),
        ChatModel::None => None,
    };
    if let Some(model) = fixtures {
        for file in ["tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(fixture(model, file), dir.0.join(file)).expect("copy a fixture");
        }
    }
    dir
}

/// A GPT-2-style byte-level BPE (600 ids) trained on arithmetic problems and chat words, with
/// [`CHAT_SPECIALS`] added at their real ids, as `tokenizer.json` text (trained once).
pub(crate) fn chat_tokenizer_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .show_progress(false)
            .vocab_size(600)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let chat = "system user assistant You are Qwen, created by Alibaba Cloud. You are a \
                    helpful assistant. Cutting Knowledge Date: December 2023 Today Date:";
        let texts: Vec<String> = ArithTask::train(3)
            .problems(0..40)
            .flat_map(|p| [p.question, p.answer])
            .chain(std::iter::once(chat.to_string()))
            .collect();
        tokenizer
            .train(&mut trainer, texts.into_iter())
            .expect("train the tokenizer");
        let mut json: Value =
            serde_json::from_str(&tokenizer.to_string(false).expect("serialise")).expect("JSON");
        // In the model's vocabulary at their ids, and added (special) tokens so the text's
        // `<|im_start|>` is split out as one id before the BPE sees it.
        for (content, id) in CHAT_SPECIALS {
            json["model"]["vocab"][content] = json!(id);
            let added = json["added_tokens"]
                .as_array_mut()
                .expect("an added_tokens list");
            added.push(json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            }));
        }
        json.to_string()
    })
}
