//! A model directory for the examples' tests (`#[path]`-included): what a user downloads,
//! made small and offline.

use std::path::Path;

/// A small model directory as a user has one: a byte-level BPE `tokenizer.json` trained on the
/// generated problems with ChatML's specials, Qwen2.5's real `tokenizer_config.json` (its chat
/// template, EOS `<|im_end|>`, no BOS), and random Qwen2-layout weights (q/k/v biases, GQA,
/// tied embeddings) exported in f32.
pub fn write_model_dir(dir: &Path) -> odc::model::ModelConfig {
    use tokenizers::models::bpe::{BpeTrainer, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;

    std::fs::create_dir_all(dir).unwrap();
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .show_progress(false)
        .vocab_size(500)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .build()
        .into();
    let texts = odc::text::ArithTask::train(1)
        .problems(0..200)
        .flat_map(|p| [p.question, p.answer]);
    tokenizer.train(&mut trainer, texts).unwrap();
    tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    let vocab = tokenizer.get_vocab_size(true);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/qwen2.5");
    std::fs::copy(
        fixture.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();

    let config = odc::model::ModelConfig {
        vocab_size: vocab,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: Some(2),
        d_ff: 64,
        max_seq_len: 2048,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-6,
        qkv_bias: true,
        tie_embeddings: true,
        init_std: 0.05,
        seed: 5,
        ..odc::model::ModelConfig::tiny()
    };
    let units: Vec<Vec<f32>> = (0..odc::model::unit_count(&config))
        .map(|u| odc::model::unit_init_values(&config, u).unwrap())
        .collect();
    let options = odc::model::hf::ExportOptions {
        dtype: odc::model::hf::ExportDtype::F32,
        ..Default::default()
    };
    let weights = dir.join("weights");
    odc::model::hf::export_hf(&weights, &config, &units, &options).unwrap();
    for entry in std::fs::read_dir(&weights).unwrap() {
        let path = entry.unwrap().path();
        std::fs::rename(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::remove_dir(&weights).unwrap();
    config
}

/// `problems` as chat JSONL, one conversation per line (`{"messages": [system, user,
/// assistant]}`, the system turn only when given): the question as the user's turn, the answer
/// as the assistant's.
#[allow(dead_code)] // Not every test that includes this file writes chat data.
pub fn write_chat_jsonl(
    path: &Path,
    problems: impl Iterator<Item = odc::text::Problem>,
    system: Option<&str>,
) {
    let lines: Vec<String> = problems
        .map(|p| {
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(serde_json::json!({"role": "system", "content": system}));
            }
            messages.push(serde_json::json!({"role": "user", "content": p.question}));
            messages.push(serde_json::json!({"role": "assistant", "content": p.answer}));
            serde_json::json!({ "messages": messages }).to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}
