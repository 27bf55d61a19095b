//! The example's data: generated problems, GSM8K or chat JSONL as training samples in the run's
//! text format, read in order from a position that checkpoints carry.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use odc::checkpoint::Opened;
use odc::recipe::Process;
use odc::text::{ArithTask, ByteTokenizer, HfTokenizer, Message, Problem, TextFormat, Tokenizer};
use odc::SampleMeta;
use serde::{Deserialize, Serialize};

use crate::settings::Settings;

/// The data of a run: the training set, the longest sample it takes, and what is held out: the
/// problems answered for accuracy and the samples the eval loss is over.
pub(crate) struct Data {
    pub(crate) dataset: Dataset,
    pub(crate) max_len: usize,
    pub(crate) eval_set: Vec<Problem>,
    pub(crate) eval_samples: Vec<odc::model::Sample>,
}

impl Data {
    /// The training data, the longest sample it takes, and the held-out data that fits.
    pub(crate) fn load(settings: &Settings, format: &TextFormat) -> anyhow::Result<Data> {
        let dataset = match &settings.data {
            Some(path) => Dataset::load(path, "training")?,
            None => Dataset::Generated(
                ArithTask::train(settings.seed).with_max_value(settings.max_value),
            ),
        };
        if matches!(dataset, Dataset::Chat(_)) && !format.is_chat() {
            bail!(
                "{}: chat data needs the model's chat template: give --model-dir",
                settings
                    .data
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
        }
        // Samples longer than the model's positions are skipped, and without splitting those
        // longer than a micro-batch too (with it, the planner cuts them into pieces within the
        // budget).
        let splits = settings
            .split
            .parse::<odc::SplitPolicy>()
            .is_ok_and(|p| p != odc::SplitPolicy::Off);
        let max_len = if splits {
            settings.model.max_seq_len
        } else {
            settings
                .model
                .max_seq_len
                .min(usize::try_from(settings.token_budget).unwrap_or(usize::MAX))
        };
        let (eval_set, eval_samples) = held_out(settings, format, max_len)?;
        Ok(Data {
            dataset,
            max_len,
            eval_set,
            eval_samples,
        })
    }

    /// Whether anything is held out to evaluate on.
    pub(crate) fn evaluates(&self) -> bool {
        !self.eval_samples.is_empty()
    }
}

/// What is held out, as training skips what does not fit `max_len`: the first
/// `--eval-problems` problems (of `--eval-data`'s GSM8K JSONL, or of the generated evaluation
/// split without `--data`) with their samples; or `--eval-data`'s first conversations that fit
/// (chat JSONL: samples for the eval loss, no problems to answer).
fn held_out(
    settings: &Settings,
    format: &TextFormat,
    max_len: usize,
) -> anyhow::Result<(Vec<Problem>, Vec<odc::model::Sample>)> {
    let wanted = settings.eval_problems;
    let problems = match (&settings.eval_data, &settings.data) {
        (Some(path), _) => match Dataset::load(path, "evaluation")? {
            Dataset::Chat(conversations) => {
                let mut samples = Vec::with_capacity(wanted);
                for (i, messages) in conversations.iter().enumerate() {
                    if samples.len() == wanted {
                        break;
                    }
                    let sample = format
                        .chat_sample(messages)
                        .with_context(|| format!("--eval-data {} record {i}", path.display()))?;
                    if sample.len() <= max_len {
                        samples.push(odc::model::Sample::from(&sample));
                    }
                }
                return Ok((Vec::new(), samples));
            }
            Dataset::File(problems) => problems.to_vec(),
            Dataset::Generated(_) => Vec::new(),
        },
        (None, Some(_)) => Vec::new(),
        (None, None) => ArithTask::eval(settings.seed)
            .with_max_value(settings.max_value)
            .problems(0..(wanted as u64).saturating_mul(100))
            .collect(),
    };
    let problems = format.fitting(problems, max_len, wanted)?;
    let samples = problems
        .iter()
        .map(|p| Ok(odc::model::Sample::from(&format.problem_sample(p)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((problems, samples))
}

/// The training data: generated problems, a file's problems or conversations in order (cycled).
#[derive(Clone)]
pub(crate) enum Dataset {
    Generated(ArithTask),
    File(Arc<Vec<Problem>>),
    Chat(Arc<Vec<Vec<Message>>>),
}

impl Dataset {
    /// `--data PATH` (`what`: "training") or `--eval-data PATH` ("evaluation"): chat JSONL when
    /// its first record has `messages`, else GSM8K JSONL.
    pub(crate) fn load(path: &Path, what: &str) -> anyhow::Result<Dataset> {
        // The first non-empty line says which; the loader then reads the file once.
        use std::io::BufRead;
        let file = std::fs::File::open(path)
            .with_context(|| format!("reading the {what} data {}", path.display()))?;
        let first = std::io::BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        let chat = serde_json::from_str::<serde_json::Value>(&first)
            .map(|v| v.get("messages").is_some())
            .unwrap_or(false);
        let dataset = if chat {
            Dataset::Chat(Arc::new(odc::text::conversation::load(path)?))
        } else {
            Dataset::File(Arc::new(
                odc::text::gsm8k::load(path).with_context(|| format!("loading the {what} data"))?,
            ))
        };
        let empty = match &dataset {
            Dataset::File(records) => records.is_empty(),
            Dataset::Chat(records) => records.is_empty(),
            Dataset::Generated(_) => false,
        };
        if empty {
            bail!("{}: no {what} records", path.display());
        }
        Ok(dataset)
    }

    /// Record `index` as a conversation (a problem as the user's question and the assistant's
    /// answer).
    pub(crate) fn messages(&self, index: u64) -> Vec<Message> {
        match self {
            Dataset::Chat(records) => records[(index % records.len() as u64) as usize].clone(),
            other => other
                .problem(index)
                .map(|p| p.messages())
                .unwrap_or_default(),
        }
    }

    /// Record `index` as a problem (`None` for a conversation).
    pub(crate) fn problem(&self, index: u64) -> Option<Problem> {
        match self {
            Dataset::Generated(task) => Some(task.problem(index)),
            Dataset::File(records) => {
                Some(records[(index % records.len() as u64) as usize].clone())
            }
            Dataset::Chat(_) => None,
        }
    }
}

/// Record `index` of `dataset` as a training sample (loss on the answer / the assistant).
pub(crate) fn sample_of(
    format: &TextFormat,
    dataset: &Dataset,
    index: u64,
) -> Result<odc::text::Sample, String> {
    let sample = match dataset.problem(index) {
        Some(problem) => format.problem_sample(&problem),
        None => format.chat_sample(&dataset.messages(index)),
    };
    sample.map_err(|e| format!("record {index}: {e}"))
}

/// Where the data stands (saved in checkpoints): the next problem index to read.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub(crate) struct DataPosition {
    pub(crate) next: u64,
}

/// What `state.json` holds besides the step.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Saved {
    pub(crate) settings: Settings,
    pub(crate) data: DataPosition,
}

/// Where a resumed run's data stands, from its checkpoint's `state.json`, whose settings must be
/// this run's (the same tokenizer and model); from the start without a checkpoint.
pub(crate) fn resumed_at(
    settings: &Settings,
    resumed: Option<(PathBuf, Opened)>,
    process: &Process,
) -> anyhow::Result<(DataPosition, Option<Opened>)> {
    let Some((dir, state)) = resumed else {
        return Ok((DataPosition { next: 0 }, None));
    };
    let saved: Saved = serde_json::from_value(state.extra().clone())
        .with_context(|| format!("{}: state.json has no sft settings", dir.display()))?;
    if !same_tokenizer(&saved.settings.tokenizer, &settings.tokenizer) {
        let name = |t: &Option<PathBuf>| match t {
            Some(path) => path.display().to_string(),
            None => "the byte tokenizer".into(),
        };
        bail!(
            "{}: the checkpoint's tokenizer is {}, this run's {}",
            dir.display(),
            name(&saved.settings.tokenizer),
            name(&settings.tokenizer)
        );
    }
    if saved.settings.model != settings.model {
        bail!(
            "{}: the checkpoint's model is {:?}, this run's {:?}",
            dir.display(),
            saved.settings.model,
            settings.model
        );
    }
    process.say(format!(
        "resuming from {} at step {} (problem {})",
        dir.display(),
        state.step(),
        saved.data.next
    ));
    Ok((saved.data, Some(state)))
}

/// The run's text format: a model directory's tokenizer and chat template, or plain text with
/// `--tokenizer` (else bytes). Without a model directory, the model's `vocab_size` becomes the
/// tokenizer's size unless the `[model]` table set one, which must then hold every id.
pub(crate) fn load_format(
    settings: &mut Settings,
    model_given: bool,
) -> anyhow::Result<TextFormat> {
    if let Some(dir) = &settings.model_dir {
        let tokenizer = HfTokenizer::from_dir(dir)?;
        if tokenizer.chat_template().is_none() {
            bail!(
                "{}: its tokenizer_config.json has no chat_template (a base model): \
                 fine-tune an instruct model, or add a template",
                dir.display()
            );
        }
        if settings.model.vocab_size < tokenizer.vocab_size() {
            bail!(
                "{}: config.json's vocab_size = {} is smaller than the tokenizer's {} ids",
                dir.display(),
                settings.model.vocab_size,
                tokenizer.vocab_size()
            );
        }
        return Ok(TextFormat::Chat(Arc::new(tokenizer)));
    }
    let (tokenizer, name): (Arc<dyn Tokenizer>, String) = match &settings.tokenizer {
        Some(path) => (
            Arc::new(HfTokenizer::from_file(path)?),
            format!("the tokenizer {}", path.display()),
        ),
        None => (Arc::new(ByteTokenizer), "the byte tokenizer".into()),
    };
    let ids = tokenizer.vocab_size();
    if !model_given {
        settings.model.vocab_size = ids;
    } else if settings.model.vocab_size < ids {
        bail!(
            "the [model] table's vocab_size = {} is smaller than the {ids} ids of {name}: \
             raise it to at least {ids}",
            settings.model.vocab_size
        );
    }
    Ok(TextFormat::Plain(tokenizer))
}

/// Whether two `tokenizer` settings are the same file (or both the byte tokenizer).
fn same_tokenizer(a: &Option<PathBuf>, b: &Option<PathBuf>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
        }
        _ => false,
    }
}

/// The next `batch` records from `position` whose sample fits `max_len`; advances `position`.
pub(crate) fn next_minibatch(
    format: &TextFormat,
    dataset: &Dataset,
    position: &mut DataPosition,
    batch: usize,
    max_len: usize,
) -> odc::Result<Vec<SampleMeta>> {
    let mut out = Vec::with_capacity(batch);
    let mut skipped = 0;
    while out.len() < batch {
        let index = position.next;
        position.next += 1;
        let sample = sample_of(format, dataset, index).map_err(odc::Error::user)?;
        if sample.len() > max_len {
            skipped += 1;
            if skipped > 100 * batch {
                return Err(odc::Error::Config(format!(
                    "no record near index {index} fits {max_len} tokens"
                )));
            }
            continue;
        }
        out.push(sample.meta(index));
    }
    Ok(out)
}
