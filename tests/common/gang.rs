//! A sample's attention whole and split over a gang of threads (sequence splitting's ring
//! attention), for the tests that compare them (`#[path]`-included).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor, Var};
use odc::model::attention::{blocked_packed_attend, gang_attend};
use odc::model::config::Blocks;
use odc::model::gang::{GangLayout, GangLink, InProcessGang};

/// An attention's output and its inputs' gradients for the output gradient `r`: `[out, dq, dk,
/// dv]` in fp32, each `[1, heads, t, hd]` (`[1, kv, t, hd]`) in the sample's order.
pub type Attended = [Tensor; 4];

fn gradients(vars: &[Var; 3], out: &Tensor, r: &Tensor) -> Attended {
    let out = out.to_dtype(DType::F32).unwrap();
    let grads = out.mul(r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = |i: usize| {
        grads
            .get(vars[i].as_tensor())
            .expect("a gradient")
            .to_dtype(DType::F32)
            .unwrap()
    };
    [out, g(0), g(1), g(2)]
}

/// `qkv = [q, k, v]` (`[1, heads, t, hd]`, `[1, kv, t, hd]` twice) attended whole by candle's
/// blocked attention (their dtype).
pub fn whole(qkv: &[Tensor; 3], r: &Tensor, blocks: Blocks) -> Attended {
    let t = qkv[0].dim(2).unwrap();
    let vars = qkv.clone().map(|x| Var::from_tensor(&x).unwrap());
    let [q, k, v] = vars.each_ref().map(|v| v.as_tensor());
    let out = blocked_packed_attend(q, k, v, &[(0, t)], blocks).unwrap();
    gradients(&vars, &out, r)
}

/// The same sample through a gang of `members` threads in `dtype`, each holding its zig-zag
/// chunks (on `qkv`'s device); the members' results put back in the sample's order.
pub fn split(
    qkv: &[Tensor; 3],
    r: &Tensor,
    members: usize,
    dtype: DType,
    blocks: Blocks,
) -> Attended {
    let t = qkv[0].dim(2).unwrap();
    let device = qkv[0].device();
    let links = InProcessGang::links(members, Duration::from_secs(120));
    let parts: Vec<(Vec<usize>, Attended)> = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(m, link)| {
                s.spawn(move || {
                    let layout = GangLayout::zigzag(t, members, m).unwrap();
                    let positions = layout.positions();
                    let index: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
                    let index = Tensor::new(index, device).unwrap();
                    let local = |x: &Tensor| x.index_select(&index, 2).unwrap();
                    let vars = qkv
                        .clone()
                        .map(|x| Var::from_tensor(&local(&x).to_dtype(dtype).unwrap()).unwrap());
                    let [q, k, v] = vars.each_ref().map(|v| v.as_tensor());
                    let link: Arc<dyn GangLink> = link;
                    let out = gang_attend(q, k, v, &layout, link, 3, blocks).unwrap();
                    (positions, gradients(&vars, &out, &local(r)))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a member"))
            .collect()
    });
    let mut positions = Vec::new();
    let mut pieces: [Vec<Tensor>; 4] = Default::default();
    for (p, xs) in parts {
        positions.extend(p);
        for (i, x) in xs.into_iter().enumerate() {
            pieces[i].push(x);
        }
    }
    let mut inverse = vec![0u32; t];
    for (local, &p) in positions.iter().enumerate() {
        inverse[p] = local as u32;
    }
    let inverse = Tensor::new(inverse, device).unwrap();
    pieces.map(|xs| {
        Tensor::cat(&xs, 2)
            .unwrap()
            .index_select(&inverse, 2)
            .unwrap()
    })
}
