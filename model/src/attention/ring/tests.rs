//! The gang's guarantees (module docs of [`super`]): the ring against the blocked attention of
//! the whole sample, deadlines, aborts and what the ring sends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};

use super::*;
use crate::attention::blocked_packed_attend;
use crate::gang::InProcessGang;
use crate::test_util::{err, random};

/// Output and gradients of q, k, v of `sum(attention(q, k, v) · r)`.
fn whole(qkv: &[Tensor; 3], r: &Tensor, blocks: Blocks) -> [Tensor; 4] {
    let t = qkv[0].dim(2).unwrap();
    let vars = qkv.clone().map(|x| Var::from_tensor(&x).unwrap());
    let out = blocked_packed_attend(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        &[(0, t)],
        blocks,
    )
    .unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |i: usize| grads.get(vars[i].as_tensor()).unwrap().clone();
    [out, g(0), g(1), g(2)]
}

/// The same through a gang of `members` threads, each holding its zig-zag chunks; the members'
/// results put back in the sample's order.
fn split(
    qkv: &[Tensor; 3],
    r: &Tensor,
    members: usize,
    blocks: Blocks,
    links: Vec<Arc<dyn GangLink>>,
) -> Result<[Tensor; 4]> {
    let t = qkv[0].dim(2)?;
    let results: Vec<Result<(Vec<usize>, [Tensor; 4])>> = thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(m, link)| {
                s.spawn(move || -> Result<(Vec<usize>, [Tensor; 4])> {
                    let layout = GangLayout::zigzag(t, members, m)?;
                    let positions = layout.positions();
                    let index = Tensor::new(
                        positions.iter().map(|&p| p as u32).collect::<Vec<_>>(),
                        &Device::Cpu,
                    )?;
                    let local = |x: &Tensor| x.index_select(&index, 2);
                    let vars = [
                        Var::from_tensor(&local(&qkv[0])?)?,
                        Var::from_tensor(&local(&qkv[1])?)?,
                        Var::from_tensor(&local(&qkv[2])?)?,
                    ];
                    let out = gang_attend(
                        vars[0].as_tensor(),
                        vars[1].as_tensor(),
                        vars[2].as_tensor(),
                        &layout,
                        link,
                        3,
                        blocks,
                    )?;
                    let grads = (&out * local(r)?)?.sum_all()?.backward()?;
                    let g = |i: usize| -> Result<Tensor> {
                        grads
                            .get(vars[i].as_tensor())
                            .cloned()
                            .ok_or_else(|| Error::Gang("no gradient".into()))
                    };
                    Ok((positions, [out, g(0)?, g(1)?, g(2)?]))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a member panicked"))
            .collect()
    });
    let mut positions = Vec::new();
    let mut parts: [Vec<Tensor>; 4] = Default::default();
    for r in results {
        let (p, xs) = r?;
        positions.extend(p);
        for (i, x) in xs.into_iter().enumerate() {
            parts[i].push(x);
        }
    }
    // The inverse of the members' concatenated order.
    let mut inverse = vec![0u32; t];
    for (local, &p) in positions.iter().enumerate() {
        inverse[p] = local as u32;
    }
    let inverse = Tensor::new(inverse, &Device::Cpu)?;
    let put_back =
        |xs: &[Tensor]| -> Result<Tensor> { Ok(Tensor::cat(xs, 2)?.index_select(&inverse, 2)?) };
    Ok([
        put_back(&parts[0])?,
        put_back(&parts[1])?,
        put_back(&parts[2])?,
        put_back(&parts[3])?,
    ])
}

fn inputs(t: usize, (heads, kv, hd): (usize, usize, usize), seed: u64) -> ([Tensor; 3], Tensor) {
    (
        [
            random(&[1, heads, t, hd], seed),
            random(&[1, kv, t, hd], seed + 1),
            random(&[1, kv, t, hd], seed + 2),
        ],
        random(&[1, heads, t, hd], seed + 3),
    )
}

fn links(members: usize, timeout: Duration) -> Vec<Arc<dyn GangLink>> {
    InProcessGang::links(members, timeout)
        .into_iter()
        .map(|l| l as Arc<dyn GangLink>)
        .collect()
}

#[test]
fn split_equals_unsplit_for_gangs_of_2_3_and_4() {
    let mut seed = 0;
    for members in [2, 3, 4] {
        for t in [2 * members, 37, 64, 101] {
            for (shape, blocks) in [
                ((4, 2, 8), Blocks { q: 5, k: 7 }),
                ((2, 2, 4), Blocks::default()),
                ((6, 1, 12), Blocks { q: 16, k: 3 }),
            ] {
                seed += 10;
                let (qkv, r) = inputs(t, shape, seed);
                let reference = whole(&qkv, &r, blocks);
                let gang = split(
                    &qkv,
                    &r,
                    members,
                    blocks,
                    links(members, Duration::from_secs(60)),
                )
                .unwrap();
                let errs: Vec<f32> = (0..4).map(|i| err(&gang[i], &reference[i])).collect();
                assert!(
                    errs.iter().all(|e| *e < 1e-5),
                    "gang of {members}, {t} tokens, shape {shape:?}, {blocks:?}: out, dq, dk, dv \
                     errors {errs:?}"
                );
            }
        }
    }
}

#[test]
fn a_sample_too_short_for_its_gang_is_an_error_naming_the_numbers() {
    let e = GangLayout::zigzag(5, 3, 0).unwrap_err();
    assert!(e.to_string().contains("5 tokens"), "{e}");
    let e = GangLayout::zigzag(64, 2, 2).unwrap_err();
    assert!(e.to_string().contains("no member 2"), "{e}");
    // Shapes that do not match the member's tokens.
    let layout = GangLayout::zigzag(16, 2, 0).unwrap();
    let (qkv, _) = inputs(9, (2, 1, 4), 1);
    let link = links(2, Duration::from_secs(1)).remove(0);
    let e = gang_attend(
        &qkv[0],
        &qkv[1],
        &qkv[2],
        &layout,
        link,
        0,
        Blocks::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("8 tokens"), "{e}");
}

#[test]
fn every_exchange_has_a_deadline_and_names_the_silent_peer() {
    // Member 1 never runs: member 0 sends its block, waits for member 1's and gives up in time.
    let t = 32;
    let (qkv, _) = inputs(t, (2, 1, 4), 7);
    let layout = GangLayout::zigzag(t, 2, 0).unwrap();
    let index: Vec<u32> = layout.positions().iter().map(|&p| p as u32).collect();
    let index = Tensor::new(index, &Device::Cpu).unwrap();
    let local = |x: &Tensor| x.index_select(&index, 2).unwrap();
    let link = links(2, Duration::from_millis(200)).remove(0);
    let started = Instant::now();
    let e = gang_attend(
        &local(&qkv[0]),
        &local(&qkv[1]),
        &local(&qkv[2]),
        &layout,
        link,
        3,
        Blocks::default(),
    )
    .unwrap_err();
    let waited = started.elapsed();
    let said = e.to_string();
    assert!(
        said.contains("member 1's attention call 3 forward step 0") && said.contains("deadline"),
        "{said}"
    );
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}

#[test]
fn an_aborted_gang_fails_at_once() {
    let t = 32;
    let (qkv, r) = inputs(t, (2, 1, 4), 9);
    let all = links(3, Duration::from_secs(600));
    all[2].abort("its compute failed");
    let started = Instant::now();
    let e = split(&qkv, &r, 3, Blocks::default(), all).unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
    assert!(e.to_string().contains("its compute failed"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// A link that counts what its member sends, per pass.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn GangLink>,
    messages: [AtomicUsize; 2],
    tensors: [AtomicUsize; 2],
}

impl GangLink for Counting {
    fn member(&self) -> usize {
        self.inner.member()
    }
    fn members(&self) -> usize {
        self.inner.members()
    }
    fn send(&self, to: usize, tag: Tag, tensors: Vec<Tensor>) -> Result<()> {
        let pass = (tag.pass == Pass::Backward) as usize;
        self.messages[pass].fetch_add(1, Ordering::Relaxed);
        self.tensors[pass].fetch_add(tensors.len(), Ordering::Relaxed);
        self.inner.send(to, tag, tensors)
    }
    fn recv(&self, from: usize, tag: Tag) -> Result<Vec<Tensor>> {
        self.inner.recv(from, tag)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

#[test]
fn the_ring_sends_what_the_cost_model_counts() {
    for members in [2usize, 3, 4] {
        let (qkv, r) = inputs(40, (2, 1, 4), 11);
        let counting: Vec<Arc<Counting>> = links(members, Duration::from_secs(60))
            .into_iter()
            .map(|inner| {
                Arc::new(Counting {
                    inner,
                    messages: Default::default(),
                    tensors: Default::default(),
                })
            })
            .collect();
        let as_links = counting
            .iter()
            .map(|c| c.clone() as Arc<dyn GangLink>)
            .collect();
        split(&qkv, &r, members, Blocks::default(), as_links).unwrap();
        for c in &counting {
            let get = |x: &[AtomicUsize; 2], i: usize| x[i].load(Ordering::Relaxed);
            // Forward: k − 1 K/V blocks. Backward: k − 1 blocks with their dK/dV, one dK/dV home.
            assert_eq!(get(&c.messages, 0), members - 1);
            assert_eq!(get(&c.tensors, 0), 2 * (members - 1));
            assert_eq!(get(&c.messages, 1), members);
            assert_eq!(get(&c.tensors, 1), 4 * (members - 1) + 2);
        }
    }
}

// --- The whole model: a split sample trains as the unsplit one -------------------------------

mod model {
    use super::*;
    use crate::batch::{GangPiece, PackedBatch, Sample};
    use crate::config::{ModelConfig, RopeScaling};
    use crate::params::unit_vars;
    use crate::transformer::{model_forward, unit_count, unit_init_values, unit_params};

    /// odc's reference model, small.
    fn reference() -> ModelConfig {
        ModelConfig {
            vocab_size: 16,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            d_ff: 64,
            max_seq_len: 128,
            init_std: 0.1,
            seed: 3,
            ..ModelConfig::tiny()
        }
    }

    /// A Hugging Face layout: grouped-query attention with an explicit head width, q/k/v biases,
    /// q/k norms (Qwen3), a tied head and Llama 3 rope scaling.
    fn hf_layout() -> ModelConfig {
        ModelConfig {
            n_kv_heads: Some(2),
            head_dim: Some(12),
            qkv_bias: true,
            qk_norm: true,
            tie_embeddings: true,
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            }),
            ..reference()
        }
    }

    /// The summed loss and every unit's gradient (flat, unit by unit) of one pack.
    fn loss_and_grads(c: &ModelConfig, batch: &PackedBatch) -> Result<(f64, Vec<Vec<f32>>)> {
        let vars: Vec<Vec<Var>> = (0..unit_count(c))
            .map(|u| unit_vars(&unit_init_values(c, u)?, &unit_params(c, u)?, &Device::Cpu))
            .collect::<Result<_>>()?;
        let units: Vec<Vec<Tensor>> = vars
            .iter()
            .map(|u| u.iter().map(|v| v.as_tensor().clone()).collect())
            .collect();
        let out = model_forward(c, &units, batch)?;
        let grads = out.loss_sum.backward()?;
        let mut flat = Vec::new();
        for unit in &vars {
            let mut g = Vec::new();
            for var in unit {
                match grads.get(var.as_tensor()) {
                    Some(t) => g.extend(t.flatten_all()?.to_vec1::<f32>()?),
                    None => g.extend(std::iter::repeat_n(0.0, var.elem_count())),
                }
            }
            flat.push(g);
        }
        Ok((f64::from(out.loss_sum.to_scalar::<f32>()?), flat))
    }

    fn sample(len: usize, seed: u32, prompt: usize) -> Sample {
        let tokens = (0..len as u32)
            .map(|i| (i.wrapping_mul(7).wrapping_add(seed * 5) ^ (i / 3)) % 16)
            .collect();
        let loss_mask = (0..len).map(|i| i >= prompt).collect();
        Sample { tokens, loss_mask }
    }

    /// The members' losses and gradients summed, each member packing its short samples (sample
    /// `i` to member `i mod k`) before its piece of `long`.
    fn gang_sum(
        c: &ModelConfig,
        shorts: &[Sample],
        long: &Sample,
        members: usize,
    ) -> (f64, Vec<Vec<f32>>) {
        let links = links(members, Duration::from_secs(120));
        let results: Vec<(f64, Vec<Vec<f32>>)> = thread::scope(|s| {
            let handles: Vec<_> = links
                .into_iter()
                .enumerate()
                .map(|(m, link)| {
                    s.spawn(move || {
                        let mine: Vec<Sample> = shorts
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| i % members == m)
                            .map(|(_, x)| x.clone())
                            .collect();
                        let layout = GangLayout::zigzag(long.tokens.len(), members, m).unwrap();
                        let batch = PackedBatch::pack_with_piece(
                            c,
                            &mine,
                            long,
                            GangPiece::new(layout, link),
                            &Device::Cpu,
                        )
                        .unwrap();
                        loss_and_grads(c, &batch).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut total = 0.0;
        let mut grads: Vec<Vec<f32>> = Vec::new();
        for (loss, g) in results {
            total += loss;
            if grads.is_empty() {
                grads = g;
            } else {
                for (acc, unit) in grads.iter_mut().zip(&g) {
                    for (a, x) in acc.iter_mut().zip(unit) {
                        *a += x;
                    }
                }
            }
        }
        (total, grads)
    }

    #[test]
    fn a_split_sample_trains_as_the_unsplit_one_with_packed_samples_beside_it() {
        let shorts = vec![sample(9, 1, 2), sample(13, 2, 0), sample(5, 3, 1)];
        let long = sample(70, 4, 10);
        for c in [reference(), hf_layout()] {
            let mut all = shorts.clone();
            all.push(long.clone());
            let whole = PackedBatch::pack(&c, &all, &Device::Cpu).unwrap();
            let (loss, grads) = loss_and_grads(&c, &whole).unwrap();
            assert!(loss.is_finite() && loss > 0.0);
            for members in [2, 3, 4] {
                let (split_loss, split_grads) = gang_sum(&c, &shorts, &long, members);
                assert!(
                    (split_loss - loss).abs() <= 1e-5 * loss.abs().max(1.0),
                    "gang of {members}: loss {split_loss} vs {loss}"
                );
                for (u, (a, b)) in split_grads.iter().zip(&grads).enumerate() {
                    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
                    let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        worst / scale < 1e-5,
                        "gang of {members}, unit {u}: gradient error {worst} (scale {scale})"
                    );
                    assert!(b.iter().any(|x| *x != 0.0), "unit {u} has a gradient");
                }
            }
        }
    }

    #[test]
    fn a_piece_that_does_not_match_its_sample_is_an_error() {
        let c = reference();
        let link = links(2, Duration::from_secs(1)).remove(0);
        let layout = GangLayout::zigzag(40, 2, 0).unwrap();
        let e = PackedBatch::pack_with_piece(
            &c,
            &[],
            &sample(30, 1, 0),
            GangPiece::new(layout, link),
            &Device::Cpu,
        )
        .unwrap_err();
        assert!(e.to_string().contains("30 tokens"), "{e}");
        // A token out of the vocabulary in another member's chunk (a target of this one).
        // Member 1 holds 10..30; token 30 (member 0's) is the target of its token 29.
        let mut bad = sample(40, 1, 0);
        bad.tokens[30] = 99;
        let link = links(2, Duration::from_secs(1)).remove(1);
        let layout = GangLayout::zigzag(40, 2, 1).unwrap();
        assert_eq!(layout.positions(), (10..30).collect::<Vec<_>>());
        let e =
            PackedBatch::pack_with_piece(&c, &[], &bad, GangPiece::new(layout, link), &Device::Cpu)
                .unwrap_err();
        assert!(
            e.to_string().contains("token 30 of the split sample is 99"),
            "{e}"
        );
    }
}
