//! Without `--init` or `--model-dir`: a short SFT on the generated task gives the policy and the
//! reference to start from.

use std::sync::Arc;

use odc::compute::{transformer_job_on, Objective, SampleStore};
use odc::model::{ModelConfig, Sample};
use odc::recipe::adamw;
use odc::text::{ArithTask, Tokenizer};
use odc::{LrSchedule, Precision};

use crate::args::Args;

/// SFT samples of the generated task, by problem index.
struct Problems(ArithTask, Arc<dyn Tokenizer>);

impl SampleStore for Problems {
    fn sample(&self, index: u64) -> Result<Sample, String> {
        let sample = odc::text::Sample::from_problem(&*self.1, &self.0.problem(index));
        Ok(Sample::from(&sample.map_err(|e| e.to_string())?))
    }
}

/// A short SFT on the generated task; the trained parameters.
pub(crate) async fn warm_start(
    args: &Args,
    max_value: u64,
    model: &ModelConfig,
    tokenizer: Arc<dyn Tokenizer>,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let task = ArithTask::train(args.seed).with_max_value(max_value);
    let max_len = model.max_seq_len;
    let mut next = 0u64;
    let mut job = transformer_job_on(
        model,
        None,
        Arc::new(Problems(task, tokenizer.clone())),
        Objective::CrossEntropy,
        args.placement()?,
    )?
    .trainers(args.trainers)
    .servers(args.servers)
    .optimizer(adamw(3e-3, 0.01))
    .lr_schedule(LrSchedule::WarmupCosine {
        warmup_steps: 20.min(args.sft_steps),
        total_steps: args.sft_steps,
        min_ratio: 0.1,
    })
    .clip_grad_norm(1.0)
    .token_budget(args.token_budget)
    .pull_precision(Precision::F32)
    .data(move |_step: u64| {
        let mut metas = Vec::new();
        while metas.len() < 16 {
            let s = odc::text::Sample::from_problem(&*tokenizer, &task.problem(next))
                .map_err(odc::Error::user)?;
            if s.len() <= max_len {
                metas.push(s.meta(next));
            }
            next += 1;
        }
        Ok(metas)
    })
    .build()?;
    for step in 0..args.sft_steps {
        let s = job.step().await?;
        if (step + 1) % 25 == 0 {
            println!(
                "sft step {:4}/{}  loss {:.4}",
                step + 1,
                args.sft_steps,
                s.loss
            );
        }
    }
    let params = job.parameters().await?;
    job.shutdown().await;
    Ok(params)
}
