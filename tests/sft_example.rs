//! `examples/sft` as a user runs it: a TOML config with flags overriding it, checkpoints on disk,
//! resuming one (by path, and the newest with `--resume auto`, passing over a corrupted newest
//! one), `--keep-last`, and a truncated checkpoint refused with the file named; `--tokenizer` with a Hugging Face `tokenizer.json`, a `[model]` vocabulary
//! too small for it, and a checkpoint resumed with another tokenizer, each refused with both sides
//! named.
#![cfg(feature = "candle")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The multi-process tests' helpers: finding an example, running it under a deadline.
#[allow(dead_code)]
#[path = "multiprocess/harness.rs"]
mod harness;

/// A small model directory in Hugging Face layout with a real chat template.
#[path = "common/model_dir.rs"]
mod model_dir;
use model_dir::write_model_dir;

/// The `sft.toml` of these tests: a schedule and a small model.
#[path = "common/sft_toml.rs"]
mod sft_toml;
use sft_toml::sft_toml;

/// A model small enough for a debug-profile run, and a short schedule.
fn sft_config() -> String {
    sft_toml(
        r#"
steps = 6
batch_size = 4
token_budget = 700
eval_every = 3
eval_problems = 2
max_new_tokens = 12
no_metrics = true
lr = 0.01
warmup_steps = 2
"#,
        512,
    )
}

/// Runs `sft` with the test's config and `args`; killed (failing the test) past 5 minutes (I6).
fn run(dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(harness::example("sft"));
    command.arg("--config").arg(dir.join("sft.toml")).args(args);
    harness::run(command, Duration::from_secs(300))
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `out`'s stderr, after asserting that it exited with a failure (else both streams are shown).
fn failed(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(
        !out.status.success(),
        "succeeded where it must fail:\n{stdout}\n{stderr}"
    );
    stderr
}

/// A resumed run's end: its final line is at `step`, with a loss within 1e-4 relative of
/// `uninterrupted` (the last loss of the same run never stopped).
fn assert_resumed_to(stdout: &str, step: u64, uninterrupted: f64) {
    let (last, loss, _) = final_line(stdout);
    assert_eq!(last, step, "{stdout}");
    assert!(
        ((loss - uninterrupted) / uninterrupted).abs() < 1e-4,
        "resumed run's last loss {loss} vs uninterrupted {uninterrupted}"
    );
}

/// `final step=<n> loss=<f> eval_accuracy=<f> eval_loss=<f>` as (n, loss, accuracy).
fn final_line(stdout: &str) -> (u64, f64, f64) {
    (
        final_field(stdout, "step").parse().unwrap(),
        final_field(stdout, "loss").parse().unwrap(),
        final_field(stdout, "eval_accuracy").parse().unwrap(),
    )
}

/// The value of `name=` on the final line.
fn final_field(stdout: &str, name: &str) -> String {
    let last = stdout.lines().last().expect("some output");
    assert!(last.starts_with("final "), "last line: {last:?}");
    last.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name}= in {last:?}"))
        .to_string()
}

/// The run's logs hold every step's figures and each evaluation's, the same in JSONL and in
/// TensorBoard's event file (read back by the format's reader, every checksum checked); the
/// MFU printed beside tokens/s is the one logged.
fn assert_logged(stdout: &str, jsonl: &Path, tensorboard: &Path, loss: f64, eval_loss: f64) {
    let records = odc::recipe::log::read_jsonl(jsonl).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.0).collect();
    // Steps 1..=6, and the evaluations after steps 3 and 6.
    assert_eq!(steps, [1, 2, 3, 3, 4, 5, 6, 6], "{records:?}");
    let value = |i: usize, name: &str| {
        let found = records[i].1.iter().find(|(n, _)| n == name);
        found
            .unwrap_or_else(|| panic!("no {name} in {:?}", records[i]))
            .1
    };
    assert_eq!(value(6, "loss"), loss);
    assert_eq!(value(7, "eval_loss"), eval_loss);
    let mfu = value(6, "mfu");
    assert!(mfu > 0.0 && mfu < 1.0, "mfu {mfu}");
    assert!(value(0, "learning_rate") > 0.0 && value(5, "tokens_per_s") > 0.0);
    let summary = stdout.lines().find(|l| l.contains("MFU")).unwrap_or("");
    assert!(
        summary.contains(&format!("MFU {:.2}%", mfu * 100.0)),
        "{stdout}"
    );
    let files = odc::recipe::tensorboard::event_files(tensorboard).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = odc::recipe::tensorboard::read_events(&files[0]).unwrap();
    let losses: Vec<(i64, f32)> = events
        .iter()
        .flat_map(|e| e.scalars.iter().map(move |(tag, v)| (e.step, tag, *v)))
        .filter(|(_, tag, _)| *tag == "loss")
        .map(|(step, _, v)| (step, v))
        .collect();
    assert_eq!(losses.len(), 6);
    assert_eq!(losses[5], (6, loss as f32));
}

#[test]
fn config_file_checkpoints_resume_and_a_truncated_checkpoint() {
    let dir = std::env::temp_dir().join(format!("odc-sft-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("sft.toml"), sft_config()).unwrap();
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();

    // The whole run, checkpointing every 3 steps, its figures logged to JSONL and TensorBoard.
    let (jsonl, tensorboard) = (dir.join("log.jsonl"), dir.join("tb"));
    let out = run(
        &dir,
        &[
            "--checkpoint-every",
            "3",
            "--checkpoint-dir",
            ckpt_arg,
            "--log-jsonl",
            jsonl.to_str().unwrap(),
            "--tensorboard",
            tensorboard.to_str().unwrap(),
        ],
    );
    let stdout = harness::succeeded(&out, "the whole run");
    let (step, loss, accuracy) = final_line(&stdout);
    assert_eq!(step, 6);
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    assert!((0.0..=1.0).contains(&accuracy), "accuracy {accuracy}");
    assert!(stdout.contains("eval step 3:"), "{stdout}");
    let eval_loss: f64 = final_field(&stdout, "eval_loss").parse().unwrap();
    assert!(eval_loss.is_finite() && eval_loss > 0.0, "{stdout}");
    assert_logged(&stdout, &jsonl, &tensorboard, loss, eval_loss);
    // The header says how the cores were split over the trainers (`share_cpu_threads`).
    assert!(
        stdout.contains("CPU thread(s) per trainer") || stdout.contains("CPU threads as set by"),
        "{stdout}"
    );
    for step in ["step-3", "step-6"] {
        // Sharded: the one server's file, the state and the manifest.
        for file in ["shard-00000.safetensors", "state.json", "manifest.json"] {
            assert!(
                ckpt.join(step).join(file).is_file(),
                "{step}/{file} missing"
            );
        }
    }

    // Resuming at step 3 ends where the uninterrupted run ended.
    let resume = ckpt.join("step-3");
    let out = run(&dir, &["--resume", resume.to_str().unwrap()]);
    let stdout = harness::succeeded(&out, "resuming at step 3");
    assert!(stdout.contains("resuming from"), "{stdout}");
    assert_resumed_to(&stdout, 6, loss);

    // A flag overrides the file.
    let out = run(&dir, &["--steps", "2", "--eval-every", "0"]);
    let stdout = harness::succeeded(&out, "--steps over the file");
    assert_eq!(final_line(&stdout).0, 2);

    // `--resume auto`: the newest checkpoint of --checkpoint-dir (one more step after step 6);
    // without --checkpoint-dir, a clear error before anything runs.
    let out = run(
        &dir,
        &[
            "--resume",
            "auto",
            "--checkpoint-dir",
            ckpt_arg,
            "--steps",
            "7",
            "--eval-every",
            "0",
        ],
    );
    let stdout = harness::succeeded(&out, "--resume auto");
    assert!(
        stdout.contains(&format!(
            "resuming from {} at step 6",
            ckpt.join("step-6").display()
        )),
        "{stdout}"
    );
    assert_eq!(final_line(&stdout).0, 7);
    let stderr = failed(&run(&dir, &["--resume", "auto"]));
    assert!(
        stderr.contains("--resume auto") && stderr.contains("--checkpoint-dir"),
        "{stderr}"
    );

    // Issue 30: 64 bytes flipped in the middle of the newest checkpoint's model (its header
    // intact). `--resume auto`, here from the config file's `resume` key, passes it over naming
    // why, resumes from step 3 and ends where the uninterrupted run ended.
    let model6 = ckpt.join("step-6").join("shard-00000.safetensors");
    let mut bytes = std::fs::read(&model6).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 64] {
        *b ^= 0xff;
    }
    std::fs::write(&model6, &bytes).unwrap();
    let with_resume = format!(
        "resume = \"auto\"\ncheckpoint_dir = \"{}\"\n{}",
        ckpt.display(),
        sft_config()
    );
    std::fs::write(dir.join("sft.toml"), with_resume).unwrap();
    let out = run(&dir, &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("resuming from {} at step 3", resume.display())),
        "{stdout}"
    );
    assert!(
        stderr.contains("step-6") && stderr.contains("passed over") && stderr.contains("checksum"),
        "{stderr}"
    );
    assert_resumed_to(&stdout, 6, loss);
    std::fs::write(dir.join("sft.toml"), sft_config()).unwrap();

    // A checkpoint at the run's last step (a rank killed after writing it): nothing left to
    // train, and that is a success; the export the killed attempt may not have reached is done.
    let exported = dir.join("exported");
    let out = run(
        &dir,
        &[
            "--resume",
            resume.to_str().unwrap(),
            "--steps",
            "3",
            "--export-hf",
            exported.to_str().unwrap(),
        ],
    );
    let stdout = harness::succeeded(&out, "resuming at the last step");
    assert!(stdout.contains("nothing left to train"), "{stdout}");
    assert!(stdout.contains("exported: "), "{stdout}");
    assert!(exported.join("config.json").is_file() && exported.join("model.safetensors").is_file());

    // `--keep-last 2`: only the two newest checkpoints stay.
    let kept = dir.join("kept");
    let kept_arg = kept.to_str().unwrap();
    let args = [
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "1",
    ];
    let mut args = args.to_vec();
    args.extend(["--keep-last", "2", "--checkpoint-dir", kept_arg]);
    harness::succeeded(&run(&dir, &args), "--keep-last 2");
    let mut left: Vec<String> = std::fs::read_dir(&kept)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-2", "step-3"]);

    // A truncated checkpoint: a clear error naming the file, no panic.
    let model = resume.join("shard-00000.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let stderr = failed(&run(&dir, &["--resume", resume.to_str().unwrap()]));
    assert!(
        stderr.contains("shard-00000.safetensors") && stderr.contains("truncated"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // An unknown key in the config file is named.
    let misspelt = sft_config().replace("[model]", "stepz = 3\n[model]");
    std::fs::write(dir.join("sft.toml"), misspelt).unwrap();
    let stderr = failed(&run(&dir, &[]));
    assert!(stderr.contains("stepz"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A word-level `tokenizer.json` over the words of the first generated training problems (`[UNK]`
/// for the rest, `<s>`, `</s>`, `<pad>` special), saved in `dir`; its path and vocabulary size.
fn save_word_level_tokenizer(dir: &Path) -> (PathBuf, usize) {
    use tokenizers::models::wordlevel::{WordLevel, WordLevelTrainer};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::AddedToken;

    let model = WordLevel::builder()
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(WhitespaceSplit));
    let mut trainer: TrainerWrapper = WordLevelTrainer::builder()
        .show_progress(false)
        .special_tokens(
            ["[UNK]", "<s>", "</s>", "<pad>"]
                .map(|name| AddedToken::from(name, true))
                .to_vec(),
        )
        .build()
        .unwrap()
        .into();
    let texts = odc::text::ArithTask::train(0)
        .problems(0..100)
        .flat_map(|p| [p.question, p.answer]);
    tokenizer.train(&mut trainer, texts).unwrap();
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).unwrap();
    (path, tokenizer.get_vocab_size(true))
}

#[test]
fn hf_tokenizer_trains_checkpoints_and_mismatches_are_named() {
    let dir = std::env::temp_dir().join(format!("odc-sft-example-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (tokenizer, vocab) = save_word_level_tokenizer(&dir);
    assert!(vocab > 259 && vocab < 4096, "{vocab} words");
    let tokenizer_arg = tokenizer.to_str().unwrap();
    let ckpt = dir.join("ckpt");

    // A `[model]` table whose vocabulary is smaller than the tokenizer's: both numbers named.
    std::fs::write(dir.join("sft.toml"), sft_config()).unwrap();
    let stderr = failed(&run(&dir, &["--tokenizer", tokenizer_arg]));
    assert!(
        stderr.contains("vocab_size = 259") && stderr.contains(&format!("{vocab} ids")),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Two steps with the tokenizer, a checkpoint and an evaluation at the end.
    let config = sft_config()
        .replace("vocab_size = 259", "vocab_size = 4096")
        .replace("steps = 6", "steps = 2")
        .replace("eval_every = 3", "eval_every = 0");
    std::fs::write(dir.join("sft.toml"), config).unwrap();
    let out = run(
        &dir,
        &[
            "--tokenizer",
            tokenizer_arg,
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    let stdout = harness::succeeded(&out, "two steps with the tokenizer");
    let (step, loss, accuracy) = final_line(&stdout);
    assert_eq!(step, 2);
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    assert!((0.0..=1.0).contains(&accuracy), "accuracy {accuracy}");
    assert!(stdout.contains("eval step 2:"), "{stdout}");

    // Resuming it with the byte tokenizer: both tokenizers named.
    let resume = ckpt.join("step-2");
    let stderr = failed(&run(
        &dir,
        &["--resume", resume.to_str().unwrap(), "--steps", "3"],
    ));
    assert!(
        stderr.contains(&format!(
            "the checkpoint's tokenizer is {}, this run's the byte tokenizer",
            tokenizer.display()
        )),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `sft --model-dir DIR --data chat.jsonl --export-hf OUT`, as the README's "Fine-tune your own
/// model" runs it: the model starts from the directory's weights, trains on chat JSONL with its
/// own template, evaluates with it, and comes back out in Hugging Face layout (bf16, the
/// tokenizer files copied) — a directory odc reads again, whose weights moved. A directory with
/// a tensor missing is refused naming the file and the tensor, before anything runs.
#[test]
fn sft_fine_tunes_a_model_directory_and_exports_it() {
    let dir = std::env::temp_dir().join(format!("odc-sft-model-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = dir.join("model");
    let config = write_model_dir(&model);
    let data = dir.join("chat.jsonl");
    let problems = odc::text::ArithTask::train(7).problems(0..40);
    model_dir::write_chat_jsonl(&data, problems, Some("Answer with the steps."));
    let out_dir = dir.join("out");
    let sft = |args: &[&str]| {
        let mut command = Command::new(harness::example("sft"));
        command.args([
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--token-budget",
            "1024",
            "--eval-problems",
            "2",
            "--max-new-tokens",
            "8",
            "--no-metrics",
            "--lr",
            "0.01",
            "--warmup-steps",
            "1",
        ]);
        command.args(args);
        harness::run(command, Duration::from_secs(300))
    };
    let (model_arg, data_arg) = (model.to_str().unwrap(), data.to_str().unwrap());
    // The model directory trained on the chat data, then `args`.
    let on_model =
        |args: &[&str]| sft(&[&["--model-dir", model_arg, "--data", data_arg][..], args].concat());
    // Held-out conversations (chat JSONL, other problems): an eval loss on the assistant's
    // turns, and no accuracy (nothing to answer).
    let eval = dir.join("chat-eval.jsonl");
    model_dir::write_chat_jsonl(&eval, odc::text::ArithTask::eval(7).problems(0..3), None);
    let args = [
        "--export-hf",
        out_dir.to_str().unwrap(),
        "--eval-data",
        eval.to_str().unwrap(),
    ];
    let stdout = harness::succeeded(&on_model(&args), "fine-tuning the model directory");
    let (step, loss, accuracy) = final_line(&stdout);
    assert_eq!(step, 4);
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    assert!(accuracy.is_nan(), "{stdout}");
    let eval_loss: f64 = final_field(&stdout, "eval_loss").parse().unwrap();
    assert!(eval_loss.is_finite() && eval_loss > 0.0, "{stdout}");
    // 2 conversations (`--eval-problems 2`) of the 3.
    assert!(
        stdout.contains(" samples)") && stdout.contains("of 2 samples"),
        "{stdout}"
    );
    assert!(stdout.contains("exported: "), "{stdout}");

    // The export: HF names in bf16, the tokenizer files beside, the same model, moved weights.
    let exported = odc::model::hf::HfCheckpoint::open(&out_dir).expect("odc reads its export");
    assert_eq!(exported.config().vocab_size, config.vocab_size);
    assert!(exported.config().tie_embeddings && exported.config().qkv_bias);
    for file in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        assert!(
            out_dir.join(file).is_file(),
            "{file} missing from the export"
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(json["torch_dtype"], "bfloat16");
    assert_eq!(json["model_type"], "qwen2");
    let start = odc::model::hf::HfCheckpoint::open(&model).unwrap();
    let moved = (0..odc::model::unit_count(&config)).all(|u| {
        let (a, b) = (
            start.unit_values(u).unwrap(),
            exported.unit_values(u).unwrap(),
        );
        a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-3)
    });
    assert!(moved, "some unit did not move in 4 steps at lr 0.01");

    // Checkpoints of a model-directory run resume: 2 steps, then 2 more from step-2, end where
    // 4 straight steps end (odc's own checkpoint format; the directory gives the config).
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let with_checkpoints = ["--checkpoint-every", "2", "--checkpoint-dir", ckpt_arg];
    let stdout = harness::succeeded(&on_model(&with_checkpoints), "2 steps, checkpointed");
    let (_, straight, _) = final_line(&stdout);
    let step2 = ckpt.join("step-2");
    let mut resumed_args = with_checkpoints.to_vec();
    resumed_args.extend(["--resume", step2.to_str().unwrap()]);
    let stdout = harness::succeeded(&on_model(&resumed_args), "2 more steps from step 2");
    assert!(stdout.contains("resuming from"), "{stdout}");
    assert_resumed_to(&stdout, 4, straight);

    // LoRA: only the adapters train; the export is PEFT's layout, or with --merge-lora the
    // merged model, whose weights moved from the base.
    let adapters = dir.join("adapters");
    let out = on_model(&[
        "--lora-rank",
        "4",
        "--export-hf",
        adapters.to_str().unwrap(),
    ]);
    let stdout = harness::succeeded(&out, "LoRA");
    assert!(stdout.contains("PEFT adapters"), "{stdout}");
    let adapter_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(adapter_config["r"], 4);
    assert_eq!(adapter_config["peft_type"], "LORA");
    let bytes = std::fs::read(adapters.join("adapter_model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.names().len(), 2 * 7 * config.n_layers);
    let b = file
        .tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
        .unwrap();
    let b: Vec<f32> = b
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert!(b.iter().any(|v| *v != 0.0), "B starts at zero and trained");

    let merged = dir.join("merged");
    let out = on_model(&[
        "--lora-rank",
        "4",
        "--merge-lora",
        "--export-dtype",
        "f32",
        "--export-hf",
        merged.to_str().unwrap(),
    ]);
    harness::succeeded(&out, "LoRA merged");
    let merged = odc::model::hf::HfCheckpoint::open(&merged).expect("a merged export loads");
    assert!(merged.config().lora.is_none());
    let block = odc::model::unit_params(&config, 1).unwrap();
    let (before, after) = (
        start.unit_values(1).unwrap(),
        merged.unit_values(1).unwrap(),
    );
    assert_eq!(before.len(), after.len());
    assert!(
        before.iter().zip(&after).any(|(x, y)| x != y),
        "merging changed none of {} block weights",
        block.len()
    );
    // Frozen under LoRA: the embedding and norms are the base's, bit for bit.
    assert_eq!(
        start.unit_values(0).unwrap(),
        merged.unit_values(0).unwrap()
    );

    // A damaged directory: one tensor missing from the weights is named before anything runs.
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, broken.join(path.file_name().unwrap())).unwrap();
    }
    let file = broken.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "model.layers.1.mlp.up_proj.weight")
        .collect();
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    let rewritten = safetensors::serialize(kept, metadata).unwrap();
    std::fs::write(&file, rewritten).unwrap();
    let stderr = failed(&sft(&["--model-dir", broken.to_str().unwrap()]));
    assert!(
        stderr.contains("model.safetensors")
            && stderr.contains("model.layers.1.mlp.up_proj.weight"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The short run `docs/examples.md` shows (its command and final line, read from the page) ends
/// within the page's stated tolerance of the line it prints: loss and eval loss within 0.01
/// (the last digits depend on the CPU's vector units), accuracy within 0.05.
#[test]
fn the_short_run_on_the_examples_page_prints_its_line_within_the_stated_tolerance() {
    let page =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples.md"))
            .unwrap();
    let marker = "`cargo run --release --example sft -- ";
    let at = page
        .find(marker)
        .expect("docs/examples.md shows a short sft run");
    let rest = &page[at + marker.len()..];
    let args: Vec<&str> = rest[..rest.find('`').unwrap()].split_whitespace().collect();
    let shown = rest
        .lines()
        .find(|l| l.starts_with("final step="))
        .expect("the short run's final line on the page");
    assert!(
        page.contains("within ±0.01"),
        "the page states the tolerance this test applies"
    );
    let mut command = Command::new(harness::example("sft"));
    command.args(&args).arg("--no-metrics");
    let stdout = harness::succeeded(&harness::run(command, Duration::from_secs(600)), shown);
    for (name, tolerance) in [
        ("step", 0.0),
        ("loss", 0.01),
        ("eval_loss", 0.01),
        ("eval_accuracy", 0.05),
    ] {
        let got: f64 = final_field(&stdout, name).parse().unwrap();
        let want: f64 = final_field(shown, name).parse().unwrap();
        assert!(
            (got - want).abs() <= tolerance,
            "{name}: {got} printed, the page shows {want} (tolerance {tolerance}):\n{stdout}"
        );
    }
}
