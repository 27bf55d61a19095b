//! A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram or WordLevel) as a [`Tokenizer`],
//! through the `tokenizers` crate (pure Rust: `fancy-regex`, no network).
//!
//! Guarantees (the tests are named after them):
//!
//! 1. **Errors name the file**: a missing or unreadable file is [`TextError::Open`], a file that
//!    is not a valid `tokenizer.json` or has no end-of-sequence token is [`TextError::Tokenizer`];
//!    each names the file and what was wrong (for a missing EOS, the names tried).
//! 2. **Special ids found by name**: EOS is the first of [`EOS_NAMES`] in the vocabulary; BOS the
//!    first of [`BOS_NAMES`], else EOS (as GPT-2 does); PAD the first of [`PAD_NAMES`], else EOS.
//! 3. **Every id is in the vocabulary**: [`Tokenizer::vocab_size`] is one past the largest id,
//!    added tokens included (the tokenizer's vocabulary size when ids are contiguous), so a model
//!    of that many ids embeds every id `encode` emits.
//! 4. **Decode skips what is not text**: BOS, EOS, PAD, every token the file marks special and
//!    every id at or past the vocabulary size are dropped; the rest goes through the file's decoder
//!    (a GPT-2-style byte-level BPE round-trips any text exactly, newlines included).

use std::path::{Path, PathBuf};

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
/// Beginning-of-sequence names tried, in order; without one, BOS is EOS.
pub const BOS_NAMES: [&str; 4] = ["<s>", "<bos>", "<|begin_of_text|>", "[CLS]"];
/// Padding names tried, in order; without one, PAD is EOS.
pub const PAD_NAMES: [&str; 3] = ["<pad>", "[PAD]", "<|pad|>"];

/// A tokenizer read from a Hugging Face `tokenizer.json`.
///
/// ```no_run
/// use odc::text::{HfTokenizer, Tokenizer};
/// let t = HfTokenizer::from_file("tokenizer.json".as_ref())?;
/// let ids = t.encode("Lena buys 3 apples.")?;
/// println!("{} ids of {}; EOS {}", ids.len(), t.vocab_size(), t.eos());
/// # Ok::<(), odc::text::TextError>(())
/// ```
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    bos: u32,
    eos: u32,
    pad: u32,
}

impl HfTokenizer {
    /// Reads `path` and finds its special ids (guarantees 1–3).
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let bytes = std::fs::read(path).map_err(|source| TextError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let error = |reason: String| TextError::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| error(format!("not a valid tokenizer.json: {e}")))?;
        let find = |names: &[&str]| names.iter().find_map(|name| inner.token_to_id(name));
        let eos = find(&EOS_NAMES).ok_or_else(|| {
            error(format!(
                "no end-of-sequence token: none of {} is in its vocabulary",
                EOS_NAMES.join(" ")
            ))
        })?;
        let bos = find(&BOS_NAMES).unwrap_or(eos);
        let pad = find(&PAD_NAMES).unwrap_or(eos);
        let largest = inner.get_vocab(true).into_values().max().unwrap_or(0);
        let vocab_size = inner.get_vocab_size(true).max(largest as usize + 1);
        Ok(HfTokenizer {
            inner,
            path: path.to_path_buf(),
            vocab_size,
            bos,
            eos,
            pad,
        })
    }

    fn error(&self, reason: String) -> TextError {
        TextError::Tokenizer {
            path: self.path.clone(),
            reason,
        }
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
            .finish()
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let encoding = self.inner.encode(text, false).map_err(|e| {
            let head: String = text.chars().take(40).collect();
            let more = if head.len() < text.len() { "…" } else { "" };
            self.error(format!("cannot encode {head:?}{more}: {e}"))
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        let text: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| {
                (id as usize) < self.vocab_size && ![self.bos, self.eos, self.pad].contains(&id)
            })
            .collect();
        self.inner
            .decode(&text, true)
            .map_err(|e| self.error(format!("cannot decode {} ids: {e}", ids.len())))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn bos(&self) -> u32 {
        self.bos
    }

    fn eos(&self) -> u32 {
        self.eos
    }

    fn pad(&self) -> u32 {
        self.pad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{prompt_tokens, ArithTask, Problem, Sample};
    use tokenizers::models::wordlevel::{WordLevel, WordLevelTrainer};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::AddedToken;

    /// A directory of its own under the system's temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("odc-hf-tokenizer-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create the temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

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
            (t.eos(), t.eos()),
            "GPT-2 style specials"
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
        assert_eq!(Some(t.bos()), raw.token_to_id("<s>"));
        assert_eq!(Some(t.eos()), raw.token_to_id("</s>"));
        assert_eq!(Some(t.pad()), raw.token_to_id("<pad>"));
        assert_eq!(t.vocab_size(), raw.get_vocab_size(true));
        assert!(t.vocab_size() > 100, "{}", t.vocab_size());
        for p in problems() {
            let ids = t.encode(&p.question).expect("encode");
            assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
        }

        // Only an EOS: BOS and PAD fall back to it, as GPT-2's `<|endoftext|>` does.
        let only_eos = TempDir::new("only-eos");
        let path = save_word_level(&only_eos.0, &problems(), &["<|endoftext|>"]);
        let t = HfTokenizer::from_file(&path).expect("a valid tokenizer.json");
        assert_eq!(t.bos(), t.eos());
        assert_eq!(t.pad(), t.eos());
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
                let mut framed = vec![t.bos()];
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
            assert_eq!(prompt[0], t.bos());
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
}
