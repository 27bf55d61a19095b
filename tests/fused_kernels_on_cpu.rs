//! The model's fused path on this CPU: `odc-kernels`' CUDA C run by `odc_kernels::emulate`
//! (compiled as C++, a block's threads as fibers, every launch in two thread orders) behind the
//! same ops, layouts, launches and backward wiring that CUDA tensors take with
//! `ODC_FUSED_KERNELS=1` ([`odc::model::ops::fused`], feature `emulate`). The kernels' own
//! checks are `kernels/tests/`; these check the model around them, where no GPU is:
//!
//! - **Against Python `transformers`** ([`logits_and_greedy_tokens_equal_transformers_with_the_fused_kernels`]):
//!   the four checkpoints of `tests/fixtures/hf/` (Llama with GQA, Llama 3 with rope scaling and
//!   a tied head, Qwen2, Qwen3 with q/k norms and an explicit head width): every position's
//!   logits of a packed batch within 1e-4 of `transformers`' (as `tests/hf_parity.rs` without the
//!   kernels), and greedy decoding of the prompts as one batch token for token equal to its
//!   `generate` (decoding's attention kernel over the KV cache).
//! - **Every gradient on the checkpoints' layouts** ([`gradients_on_the_checkpoints_layouts_equal_candles_ops`]):
//!   the same four models' loss on a packed batch and the gradient of every parameter (biases,
//!   q/k norms, tied and untied heads, rope scaling) with the kernels and with candle's ops,
//!   within 1e-5 relative (fp32).
//! - **Training** ([`training_with_the_fused_kernels_equals_candles_ops`]): the I3 job of
//!   `tests/gpu_training.rs` (2 trainers, 2 servers, several micro-batches, SGD) in fp32 with
//!   the kernels and with candle's ops: per-step losses within 1e-5 relative and every parameter
//!   within 1e-5 after the steps.
//! - **bf16 with FlashAttention-2** ([`bf16_training_with_flash_attention_tracks_fp32`]): the same
//!   job in bf16 mixed precision (heads of 64: the tensor-core tiles forward and backward) with the
//!   kernels, against candle's ops in fp32: losses within 3%, as the GPU test asks; and within
//!   1% of candle's ops in bf16.
//!
//! - **A sample split over a gang** ([`a_sample_split_over_a_gang_equals_the_whole_sample`]):
//!   ring attention with the kernels (each pair of chunks one launch: a chunk against itself
//!   causally, against an earlier one wholly), gangs of 2 and 3 members in threads, against the
//!   whole sample's blocked attention by candle's ops: the output and the gradients of q, k and
//!   v within 1e-5 relative in fp32 (the plain kernels), 1e-2 in bf16 (FlashAttention-2's tiles,
//!   heads of 64 and 128).
//!
//! - **bf16 sampling** ([`bf16_sampling_scores_as_the_training_forward_with_the_kernels`]): the
//!   decoder in bf16 (the prompts' prefill by FlashAttention-2's tiles, heads of 64; each token by
//!   decoding's kernel over a bf16 cache) draws responses whose per-token log-probs equal the
//!   training forward's by candle's ops in bf16 on the same tokens within bf16's tolerance.
//!
//! - **The residual add and its norm** ([`the_residual_add_and_its_norm_are_one_launch_equal_to_the_two_ops`]):
//!   one launch for both, equal to the two ops forward and backward.
//!
//! Each test checks that kernels ran (`fused::launches()` grew). The switch is one per process,
//! so the tests take turns ([`LOCK`]). Without a C++ compiler each test says it is skipped
//! (CI sets `ODC_REQUIRE_EMULATION=1`: there that fails).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor, Var};
use odc::compute::{transformer_job_on, Objective, Placement, SampleStore};
use odc::model::config::Blocks;
use odc::model::ops::fused;
use odc::model::{
    batch_log_probs, generate_batch, generate_batch_with_log_probs, model_forward, unit_count,
    unit_init_values, ComputePrecision, ModelConfig, PackedBatch, Prompt, Sample, Sampling,
    Weights,
};
use odc::text::{ArithTask, ByteTokenizer};
use odc::{LrSchedule, OptimizerConfig, Precision, SampleMeta, StepStats};
use odc_kernels::emulate::Emulator;

#[path = "common/gang.rs"]
mod gang;
#[path = "common/hf_fixtures.rs"]
mod hf_fixtures;
#[path = "common/params.rs"]
mod params;
use hf_fixtures::{fixtures, json, packed_logits};
use params::{max_abs_diff, worst_loss_diff};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// The process's one switch, taken by one test at a time.
static LOCK: Mutex<()> = Mutex::new(());

/// The lock, and the emulator if this machine has a compiler (else the test is skipped).
fn emulation(test: &str) -> Option<(MutexGuard<'static, ()>, Emulator)> {
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    Emulator::for_test(test).map(|e| (guard, e))
}

/// Runs `f` with the fused kernels on CPU tensors, and says how many launches it made.
fn with_kernels<T>(emulator: &Emulator, f: impl FnOnce() -> T) -> (T, u64) {
    let before = fused::launches();
    fused::emulate_on_cpu(Some(emulator.clone()));
    let out = f();
    fused::emulate_on_cpu(None);
    (out, fused::launches() - before)
}

/// Against `transformers` (see the module docs).
#[test]
fn logits_and_greedy_tokens_equal_transformers_with_the_fused_kernels() {
    let test = "logits_and_greedy_tokens_equal_transformers_with_the_fused_kernels";
    let Some((_lock, emulator)) = emulation(test) else {
        return;
    };
    for dir in fixtures() {
        let (name, config, units, tokens) = hf_fixtures::open(&dir);
        let fixture = json(&dir.join("logits.json"));
        let rows: Vec<Vec<f32>> = serde_json::from_value(fixture["logits"].clone()).unwrap();
        let reference = Tensor::new(rows, &Device::Cpu).unwrap();
        let (ours, launches) = with_kernels(&emulator, || {
            packed_logits(&config, &units, &[11, 12, 13], &tokens)
        });
        let diff = hf_fixtures::max_abs_diff(&ours, &reference);
        eprintln!("{name}: fused kernels vs transformers: max |Δ| = {diff:e}, {launches} launches");
        assert!(launches > 0, "{name}: no fused kernel ran");
        assert!(diff < 1e-4, "{name}: max |Δ| = {diff}");

        let fixture = json(&dir.join("generate.json"));
        let prompts: Vec<Vec<u32>> = serde_json::from_value(fixture["prompts"].clone()).unwrap();
        let want: Vec<Vec<u32>> = serde_json::from_value(fixture["greedy"].clone()).unwrap();
        let weights = Weights::from_units(&config, &units, &Device::Cpu).unwrap();
        let sampling = Sampling::greedy(want[0].len(), Vec::new());
        let batch: Vec<Prompt<'_>> = prompts.iter().map(|p| Prompt::new(p)).collect();
        let mut rngs: Vec<StdRng> = (0..batch.len()).map(|_| StdRng::seed_from_u64(0)).collect();
        let (got, launches) = with_kernels(&emulator, || {
            generate_batch(&weights, &batch, &sampling, &mut rngs).unwrap()
        });
        assert!(
            launches >= want[0].len() as u64,
            "{name}: {launches} launches for {} tokens",
            want[0].len()
        );
        assert_eq!(got, want, "{name}: greedy tokens with the fused kernels");
    }
}

/// The loss of `tokens` packed after `[11, 12, 13]` and the gradient of every parameter (unit by
/// unit, in `unit_params` order), fp32.
fn loss_and_gradients(
    config: &ModelConfig,
    units: &[Vec<f32>],
    tokens: &[u32],
) -> (f32, Vec<Tensor>) {
    let device = Device::Cpu;
    let vars: Vec<Vec<Var>> = units
        .iter()
        .enumerate()
        .map(|(u, v)| {
            let specs = odc::model::unit_params(config, u).unwrap();
            odc::model::unit_vars(v, &specs, &device).unwrap()
        })
        .collect();
    let params: Vec<Vec<Tensor>> = vars
        .iter()
        .map(|unit| unit.iter().map(|v| v.as_tensor().clone()).collect())
        .collect();
    let pack = [
        Sample::all_loss(vec![11, 12, 13]),
        Sample::all_loss(tokens.to_vec()),
    ];
    let batch = PackedBatch::pack(config, &pack, &device).unwrap();
    let loss = model_forward(config, &params, &batch).unwrap().loss;
    let grads = loss.backward().unwrap();
    let gradients = vars
        .iter()
        .flatten()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("every parameter has a gradient")
                .clone()
        })
        .collect();
    (loss.to_scalar::<f32>().unwrap(), gradients)
}

/// Every gradient on the checkpoints' layouts (see the module docs).
#[test]
fn gradients_on_the_checkpoints_layouts_equal_candles_ops() {
    let test = "gradients_on_the_checkpoints_layouts_equal_candles_ops";
    let Some((_lock, emulator)) = emulation(test) else {
        return;
    };
    for dir in fixtures() {
        let (name, config, units, tokens) = hf_fixtures::open(&dir);
        let (loss, want) = loss_and_gradients(&config, &units, &tokens);
        let ((fused_loss, got), launches) =
            with_kernels(&emulator, || loss_and_gradients(&config, &units, &tokens));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| relative(g, w))
            .fold(0f64, f64::max);
        eprintln!(
            "{name}: loss {fused_loss} with the kernels, {loss} without; {} gradients, worst \
             relative error {worst:.1e}, {launches} launches",
            got.len()
        );
        assert!(launches > 0, "{name}: no fused kernel ran");
        assert!(
            ((fused_loss - loss) / loss).abs() < 1e-6,
            "{name}: loss {fused_loss} vs {loss}"
        );
        assert!(worst < 1e-5, "{name}: a gradient {worst:e} off");
    }
}

/// Small enough for the emulation, heads of 64 (FlashAttention-2's tiles in bf16), grouped-query
/// heads, samples spanning several micro-batches.
fn config() -> ModelConfig {
    ModelConfig {
        d_model: 128,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: Some(1),
        d_ff: 256,
        max_seq_len: 1280,
        init_std: 0.05,
        seed: 11,
        ..ModelConfig::tiny()
    }
}

const PER_STEP: usize = 6;
const STEPS: u64 = 2;

/// The job's samples, each cut to its last `longest` tokens (the answer, which carries the loss).
fn samples(longest: usize) -> Arc<Vec<Sample>> {
    Arc::new(
        ArithTask::train(5)
            .problems(0..PER_STEP as u64 * STEPS)
            .map(|p| {
                let s = Sample::from(
                    &odc::text::Sample::from_problem(&ByteTokenizer, &p).expect("bytes"),
                );
                let cut = s.tokens.len().saturating_sub(longest);
                Sample {
                    tokens: s.tokens[cut..].to_vec(),
                    loss_mask: s.loss_mask[cut..].to_vec(),
                }
            })
            .collect(),
    )
}

/// `STEPS` SGD steps of the test job (2 trainers, 2 servers, micro-batches of `budget` tokens,
/// samples of at most half that) at `precision` on the CPU: the stats and the parameters after
/// them.
fn train(precision: ComputePrecision, budget: u64) -> (Vec<StepStats>, Vec<Vec<f32>>) {
    let data = samples(budget as usize / 2);
    let store_data = data.clone();
    let store: Arc<dyn SampleStore> = Arc::new(move |i: u64| {
        store_data
            .get(i as usize)
            .cloned()
            .ok_or_else(|| format!("no sample {i}"))
    });
    let placement = Placement {
        precision,
        ..Placement::default()
    };
    let metas = move |step: u64| {
        Ok((0..PER_STEP)
            .map(|k| {
                let i = (step as usize * PER_STEP + k) % data.len();
                SampleMeta {
                    index: i as u64,
                    tokens: data[i].tokens.len() as u64,
                    loss_tokens: data[i].loss_mask.iter().skip(1).filter(|m| **m).count() as u64,
                }
            })
            .collect())
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let run = async {
            let mut job =
                transformer_job_on(&config(), None, store, Objective::CrossEntropy, placement)
                    .expect("job")
                    .trainers(2)
                    .servers(2)
                    .optimizer(OptimizerConfig::sgd(0.5))
                    .lr_schedule(LrSchedule::Constant)
                    .pull_precision(Precision::F32)
                    .token_budget(budget)
                    .data(metas)
                    .build()
                    .expect("build");
            let stats = job.run(STEPS).await.expect("steps");
            let params = job.parameters().await.expect("parameters");
            job.shutdown().await;
            (stats, params)
        };
        tokio::time::timeout(std::time::Duration::from_secs(600), run)
            .await
            .expect("the run took more than 600 s")
    })
}

/// Training in fp32 (see the module docs).
#[test]
fn training_with_the_fused_kernels_equals_candles_ops() {
    let Some((_lock, emulator)) = emulation("training_with_the_fused_kernels_equals_candles_ops")
    else {
        return;
    };
    // fp32 takes the plain attention kernel (a warp per row and head), slow to emulate: short
    // micro-batches.
    let (ops, ops_params) = train(ComputePrecision::F32, 200);
    let ((fused, fused_params), launches) =
        with_kernels(&emulator, || train(ComputePrecision::F32, 200));
    let worst = worst_loss_diff(&ops, &fused);
    let diff = max_abs_diff(&ops_params, &fused_params);
    eprintln!(
        "fp32, {STEPS} SGD steps, fused kernels ({launches} launches) vs candle's ops: max loss \
         rel diff {worst:.3e}, max |Δparam| {diff:.3e}"
    );
    assert!(launches > 0, "no fused kernel ran");
    assert!(worst < 1e-5, "losses differ by {worst:e}");
    assert!(diff < 1e-5, "parameters differ by {diff:e}");
}

/// bf16 with FlashAttention-2 (see the module docs).
#[test]
fn bf16_training_with_flash_attention_tracks_fp32() {
    let Some((_lock, emulator)) = emulation("bf16_training_with_flash_attention_tracks_fp32")
    else {
        return;
    };
    // Micro-batches of several 128-row tiles, samples crossing them.
    let (fp32, _) = train(ComputePrecision::F32, 520);
    let (ops, _) = train(ComputePrecision::Bf16, 520);
    let ((bf16, params), launches) = with_kernels(&emulator, || train(ComputePrecision::Bf16, 520));
    let worst = worst_loss_diff(&fp32, &bf16);
    let same_precision = worst_loss_diff(&ops, &bf16);
    eprintln!(
        "bf16 with the fused kernels ({launches} launches), {STEPS} SGD steps: max loss rel diff \
         {worst:.3e} from fp32 with candle's ops, {same_precision:.3e} from bf16 with them"
    );
    assert!(
        same_precision < 1e-2,
        "bf16 losses differ from candle's ops in bf16 by {same_precision:e} (relative)"
    );
    assert!(launches > 0, "no fused kernel ran");
    assert!(
        params.iter().flatten().all(|p| p.is_finite()),
        "a non-finite parameter"
    );
    assert!(worst < 3e-2, "bf16 losses differ by {worst:e} (relative)");
}

/// `‖a − b‖ / ‖b‖`; fails on a non-finite element.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b): (Vec<f32>, Vec<f32>) = (
        a.flatten_all().unwrap().to_vec1().unwrap(),
        b.flatten_all().unwrap().to_vec1().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|x| x.is_finite()), "a non-finite element");
    let diff: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Splitting with the kernels (see the module docs).
#[test]
fn a_sample_split_over_a_gang_equals_the_whole_sample() {
    let Some((_lock, emulator)) = emulation("a_sample_split_over_a_gang_equals_the_whole_sample")
    else {
        return;
    };
    let random = |dims: &[usize], seed: u64| {
        let n: usize = dims.iter().product();
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(values, dims, &Device::Cpu).unwrap()
    };
    // (members, tokens, heads, kv heads, head width, dtype, bound)
    let cases = [
        (2, 37, 4, 2, 16, DType::F32, 1e-5),
        (3, 101, 6, 2, 32, DType::F32, 1e-5),
        (2, 300, 4, 2, 64, DType::BF16, 1e-2),
        (3, 130, 2, 1, 128, DType::BF16, 1e-2),
    ];
    for (seed, (members, t, heads, kv, hd, dtype, bound)) in cases.into_iter().enumerate() {
        let seed = 10 * seed as u64;
        let qkv = [
            random(&[1, heads, t, hd], seed),
            random(&[1, kv, t, hd], seed + 1),
            random(&[1, kv, t, hd], seed + 2),
        ];
        let r = random(&[1, heads, t, hd], seed + 3);
        let want = gang::whole(&qkv, &r, Blocks::default());
        let (got, launches) = with_kernels(&emulator, || {
            gang::split(&qkv, &r, members, dtype, Blocks::default())
        });
        let errors: Vec<f64> = got.iter().zip(&want).map(|(g, w)| relative(g, w)).collect();
        let shown: Vec<String> = errors.iter().map(|e| format!("{e:.1e}")).collect();
        eprintln!(
            "gang of {members}, {t} tokens, heads {heads}/{kv}, width {hd}, {dtype:?}: relative \
             errors (out, dq, dk, dv) {}, {launches} launches",
            shown.join(", ")
        );
        assert!(launches > 0, "no fused kernel ran");
        for (name, e) in ["out", "dq", "dk", "dv"].iter().zip(&errors) {
            assert!(*e <= bound, "{name}: {e:e} over {bound:e}");
        }
    }
}

/// bf16 sampling with the kernels (see the module docs).
#[test]
fn bf16_sampling_scores_as_the_training_forward_with_the_kernels() {
    let test = "bf16_sampling_scores_as_the_training_forward_with_the_kernels";
    let Some((_lock, emulator)) = emulation(test) else {
        return;
    };
    let c = config();
    let units: Vec<Vec<f32>> = (0..unit_count(&c))
        .map(|u| unit_init_values(&c, u).unwrap())
        .collect();
    let w = Weights::from_units(&c, &units, &Device::Cpu)
        .unwrap()
        .in_precision(ComputePrecision::Bf16)
        .unwrap();
    // Prompts of different lengths (left padding), one longer than a 128-row tile.
    let texts: Vec<Vec<u32>> = [150usize, 40, 7]
        .iter()
        .map(|&n| {
            (0..n as u32)
                .map(|i| (i * 7 + n as u32) % 200 + 1)
                .collect()
        })
        .collect();
    let prompts: Vec<Prompt<'_>> = texts.iter().map(|t| Prompt::new(t).samples(2)).collect();
    let s = Sampling::new(1.0, 12, vec![]);
    let mut rngs: Vec<StdRng> = (0..6).map(StdRng::seed_from_u64).collect();
    let (scored, launches) = with_kernels(&emulator, || {
        generate_batch_with_log_probs(&w, &prompts, &s, &mut rngs).unwrap()
    });
    let sequences: Vec<Vec<u32>> = scored
        .iter()
        .enumerate()
        .map(|(i, g)| texts[i / 2].iter().chain(&g.tokens).copied().collect())
        .collect();
    let views: Vec<&[u32]> = sequences.iter().map(|s| s.as_slice()).collect();
    let forward = batch_log_probs(&w, &views).unwrap();
    let mut worst = 0f32;
    for (i, (g, want)) in scored.iter().zip(&forward).enumerate() {
        for (got, want) in g.log_probs.iter().zip(&want[texts[i / 2].len()..]) {
            assert!(got.is_finite() && *got <= 0.0, "{got}");
            worst = worst.max((got - want).abs());
        }
    }
    eprintln!(
        "bf16 sampling with the kernels ({launches} launches) vs the bf16 training forward by \
         candle's ops: max |Δ log p| {worst}"
    );
    assert!(launches > 0, "no fused kernel ran");
    assert!(worst < 0.1, "log-probs differ by {worst}");
}

/// The residual add fused with the norm after it (`odc::model::ops::add_rms_norm`, each block's
/// attention residual and post-attention norm): one launch writes the stream and its norm, and
/// both, and the gradients of the stream, the attention's output and the norm's weight through
/// both, equal the two ops by candle's ops (fp32 within 1e-6, bf16 within 1e-2, relative).
#[test]
fn the_residual_add_and_its_norm_are_one_launch_equal_to_the_two_ops() {
    let Some((_lock, emulator)) =
        emulation("the_residual_add_and_its_norm_are_one_launch_equal_to_the_two_ops")
    else {
        return;
    };
    let (rows, cols) = (37, 96);
    let cpu = Device::Cpu;
    let randn = |shape: (usize, usize)| Tensor::randn(0f32, 1f32, shape, &cpu).unwrap();
    let (x, y, w) = (randn((rows, cols)), randn((rows, cols)), randn((1, cols)));
    let w = w.squeeze(0).unwrap().affine(0.5, 1.0).unwrap();
    let (gh, gn) = (randn((rows, cols)), randn((rows, cols)));
    for (dtype, bound) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        // The values and the gradients of x, y and w for `Σ h·gh + Σ n·gn`.
        let run = || {
            let vars = [&x, &y].map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap());
            let wv = Var::from_tensor(&w).unwrap();
            let (h, n) = odc::model::ops::add_rms_norm(&vars[0], &vars[1], &wv, 1e-6).unwrap();
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let loss = ((f32(&h) * &gh).unwrap().sum_all().unwrap()
                + (f32(&n) * &gn).unwrap().sum_all().unwrap())
            .unwrap();
            let grads = loss.backward().unwrap();
            let grad = |v: &Var| f32(grads.get(v.as_tensor()).expect("a gradient"));
            [f32(&h), f32(&n), grad(&vars[0]), grad(&vars[1]), grad(&wv)]
        };
        let want = run();
        let (got, _) = with_kernels(&emulator, run);
        let (_, launches) = with_kernels(&emulator, || {
            let (x, y) = (x.to_dtype(dtype).unwrap(), y.to_dtype(dtype).unwrap());
            odc::model::ops::add_rms_norm(&x, &y, &w, 1e-6).unwrap()
        });
        let errors: Vec<f64> = got.iter().zip(&want).map(|(g, w)| relative(g, w)).collect();
        let shown: Vec<String> = errors.iter().map(|e| format!("{e:.1e}")).collect();
        eprintln!(
            "add + rms norm, {dtype:?}: relative errors (h, n, dx, dy, dw) {}, {launches} \
             launch forward",
            shown.join(", ")
        );
        assert_eq!(
            launches, 1,
            "{dtype:?}: the add and the norm are one launch"
        );
        for (name, e) in ["h", "n", "dx", "dy", "dw"].iter().zip(&errors) {
            assert!(*e <= bound, "{dtype:?} {name}: {e:e} over {bound:e}");
        }
    }
}
