//! The gang's guarantees (module docs of [`super`]): the ring against the blocked attention of
//! the whole sample, deadlines, aborts and what the ring sends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::model::flash::blocked_packed_attend;
use crate::model::ops::tests::random;

/// `max |a − b| / max(1, max |b|)`.
fn err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let flat = |x: &Tensor| -> Vec<f32> {
        x.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (a, b) = (flat(a), flat(b));
    assert!(
        a.iter().chain(&b).all(|x| x.is_finite()),
        "a non-finite element"
    );
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

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
        said.contains("member 1's layer 3 forward step 0") && said.contains("deadline"),
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
