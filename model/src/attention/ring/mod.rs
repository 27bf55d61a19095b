//! Attention of one sample split over a gang of trainers (context parallelism, ring attention).
//!
//! A sample of `T` tokens is cut for a gang of `k` members into `2k` chunks, member `m` holding
//! chunks `m` and `2k − 1 − m` ([`GangLayout`], from `odc_policy::split::zigzag`): balanced causal
//! work. Every layer outside attention works token by token, so a member runs it on its own
//! tokens alone (at their positions in the sample, for RoPE: [`GangLayout::positions`]).
//! Attention needs every earlier key: [`gang_attend`] passes the K/V blocks around the ring —
//! each step sends the block in hand to the next member before computing on it, so the transfer
//! overlaps the block's attention — and folds the partials with the blocked attention's merge
//! rule ([`super::blocked::merge`]: output and per-row log-sum-exp). The backward passes each block
//! around once more with its dK/dV accumulators, each member adding its queries' share
//! ([`super::blocked::attend_partial_backward`]); after `k` hops the block is home with its whole
//! gradient. Where the fused kernels run ([`super::fused`]) each pair of chunks is one kernel
//! launch (a chunk against itself causally, against an earlier chunk wholly: the varlen kernels'
//! two cases), forward and backward, with the same merge rule.
//!
//! Guarantees (tested in `tests`, each named after it):
//! 1. **Split equals unsplit**: the members' outputs and the gradients of their q, k and v, put
//!    back at their positions, equal the blocked attention of the whole sample (within 1e-5 in
//!    fp32) for gangs of 2, 3 and 4, any length the cut allows, GQA and any tile sizes.
//! 2. **Every exchange has a deadline (I6)**: a member whose peer never sends fails by the link's
//!    deadline with an error naming the peer and the step; an aborted gang fails at once.
//! 3. **The exchange carries what the cost model says**: a forward sends `k − 1` K/V blocks per
//!    member and layer, a backward `k − 1` K/V blocks with their dK/dV and one dK/dV home.

#[cfg(test)]
mod tests;

use std::sync::Arc;

use candle_core::{CustomOp3, DType, Tensor, D};

use super::blocked::{attend_partial, merge, partial_backward, Partial};
use super::fused;
use crate::config::Blocks;
use crate::error::{Error, Result};
use crate::gang::{GangLayout, GangLink, Pass, Tag};
use crate::ops::precomputed::{precomputed_forwards, Precomputed};

/// One member's causal attention over its tokens of a split sample: `q: [1, H, n, hd]`,
/// `k, v: [1, KV, n, hd]` for its `n` tokens in local order ([`GangLayout::positions`]),
/// exchanging K/V with the other members over `link` under the tags of attention call `call`.
/// Every member of the gang makes the same calls in the same order (each in its own thread or
/// process); the backward exchanges again under the same call. Returns `[1, H, n, hd]` in the values' dtype.
pub fn gang_attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &GangLayout,
    link: Arc<dyn GangLink>,
    call: u32,
    blocks: Blocks,
) -> Result<Tensor> {
    let n = layout.len_of(layout.member());
    let (rows, heads, t, hd) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    if rows != 1 || t != n || k.dims4()? != (1, kv, n, hd) || v.dims4()? != (1, kv, n, hd) {
        return Err(Error::Batch(format!(
            "gang attention for member {} ({n} tokens) takes q [1, H, {n}, hd] and k, v \
             [1, KV, {n}, hd]: got q {:?}, k {:?}, v {:?}",
            layout.member(),
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if link.members() != layout.members() || link.member() != layout.member() {
        return Err(Error::Gang(format!(
            "the link is member {} of {}, the layout member {} of {}",
            link.member(),
            link.members(),
            layout.member(),
            layout.members()
        )));
    }
    let ring = Ring {
        layout: layout.clone(),
        link,
        call,
        blocks,
    };
    let (qd, kd, vd) = (q.detach().get(0)?, k.detach().get(0)?, v.detach().get(0)?);
    let (out, lse) = ring.guard(|| ring.forward(&qd, &kd, &vd))?;
    let op = GangAttention {
        ring,
        out: Precomputed::new(
            "gang attention",
            out.to_dtype(v.dtype())?.reshape((1, heads, n, hd))?,
        ),
        lse,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// One member's ring for one attention call.
#[derive(Debug, Clone)]
struct Ring {
    layout: GangLayout,
    link: Arc<dyn GangLink>,
    call: u32,
    blocks: Blocks,
}

/// A block of keys in hand: whose chunks they are, and its tensors in the owner's local order.
struct Held {
    owner: usize,
    k: Tensor,
    v: Tensor,
}

impl Ring {
    fn next(&self) -> usize {
        (self.layout.member() + 1) % self.layout.members()
    }

    fn prev(&self) -> usize {
        (self.layout.member() + self.layout.members() - 1) % self.layout.members()
    }

    fn tag(&self, pass: Pass, step: usize) -> Tag {
        Tag {
            call: self.call,
            pass,
            step: step as u32,
        }
    }

    /// Runs `f`; on failure aborts the gang, so the other members stop at once (I2: the gang's
    /// micro-batch is replayed as a whole).
    fn guard<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let result = f();
        if let Err(e) = &result {
            self.link.abort(&e.to_string());
        }
        result
    }

    /// `x` (`[heads, n, ..]`, this member's local order) cut at its two chunks.
    fn local_chunks(&self, x: &Tensor, owner: usize) -> candle_core::Result<[Tensor; 2]> {
        let [a, b] = self.layout.chunks(owner);
        Ok([x.narrow(1, 0, a.len())?, x.narrow(1, a.len(), b.len())?])
    }

    /// The pairs (query chunk, key chunk) of this member's queries and `owner`'s keys with at
    /// least one visible key.
    fn visible(&self, owner: usize) -> Vec<(usize, usize)> {
        let mine = self.layout.chunks(self.layout.member());
        let theirs = self.layout.chunks(owner);
        let mut pairs = Vec::new();
        for (qi, qr) in mine.iter().enumerate() {
            for (ki, kr) in theirs.iter().enumerate() {
                if kr.start < qr.end && !qr.is_empty() && !kr.is_empty() {
                    pairs.push((qi, ki));
                }
            }
        }
        pairs
    }

    /// The forward ring: `(out [H, n, hd] fp32, lse [H, n] fp32)`.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let members = self.layout.members();
        let me = self.layout.member();
        let mine = self.layout.chunks(me).clone();
        let qc = self.local_chunks(q, me)?;
        let mut acc: [Option<Partial>; 2] = [None, None];
        let mut held = Held {
            owner: me,
            k: k.clone(),
            v: v.clone(),
        };
        for step in 0..members {
            let last = step + 1 == members;
            if !last {
                // Sent before computing on it: the transfer overlaps this step's attention.
                self.link.send(
                    self.next(),
                    self.tag(Pass::Forward, step),
                    vec![held.k.clone(), held.v.clone()],
                )?;
            }
            let theirs = self.layout.chunks(held.owner).clone();
            let (kc, vc) = (
                self.local_chunks(&held.k, held.owner)?,
                self.local_chunks(&held.v, held.owner)?,
            );
            for (qi, ki) in self.visible(held.owner) {
                let (q, q_pos) = (&qc[qi], mine[qi].start);
                let (k, v, k_pos) = (&kc[ki], &vc[ki], theirs[ki].start);
                let p = match fused::partial(q, q_pos, k, v, k_pos)? {
                    Some(p) => p,
                    None => attend_partial(q, q_pos, k, v, k_pos, self.blocks)?,
                };
                acc[qi] = Some(match acc[qi].take() {
                    None => p,
                    Some(a) => merge(&a, &p)?,
                });
            }
            if !last {
                let got = self.link.recv(self.prev(), self.tag(Pass::Forward, step))?;
                let [k, v]: [Tensor; 2] = got.try_into().map_err(|got: Vec<Tensor>| {
                    Error::Gang(format!(
                        "member {me}: {} tensors in a forward ring message, expected 2",
                        got.len()
                    ))
                })?;
                held = Held {
                    owner: (held.owner + members - 1) % members,
                    k,
                    v,
                };
            }
        }
        // Each query chunk sees its own diagonal in its own block: both partials exist.
        let [a, b] = acc.map(|p| p.ok_or_else(|| Error::Gang("a chunk attended to no key".into())));
        let (a, b) = (a?, b?);
        Ok((
            Tensor::cat(&[&a.out, &b.out], 1)?,
            Tensor::cat(&[&a.lse, &b.lse], 1)?,
        ))
    }

    /// The backward ring: fp32 `(dq [H, n, hd], dk [KV, n, hd], dv [KV, n, hd])` of this
    /// member's tokens.
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let members = self.layout.members();
        let me = self.layout.member();
        let mine = self.layout.chunks(me).clone();
        // D = rowsum(dO ⊙ O): [H, n] fp32.
        let dd = (d_o.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?.sum(D::Minus1)?;
        let (qc, doc, lsec, ddc) = (
            self.local_chunks(q, me)?,
            self.local_chunks(d_o, me)?,
            self.local_chunks(lse, me)?,
            self.local_chunks(&dd, me)?,
        );
        let (kv_heads, _, hd) = k.dims3()?;
        let mut dq: [Option<Tensor>; 2] = [None, None];
        let mut held = Held {
            owner: me,
            k: k.clone(),
            v: v.clone(),
        };
        let zeros = |len: usize| Tensor::zeros((kv_heads, len, hd), DType::F32, k.device());
        let mut dk = Tensor::zeros(k.dims(), DType::F32, k.device())?;
        let mut dv = dk.clone();
        for step in 0..members {
            let theirs = self.layout.chunks(held.owner).clone();
            let (kc, vc) = (
                self.local_chunks(&held.k, held.owner)?,
                self.local_chunks(&held.v, held.owner)?,
            );
            let mut dkc: [Option<Tensor>; 2] = [None, None];
            let mut dvc: [Option<Tensor>; 2] = [None, None];
            for (qi, ki) in self.visible(held.owner) {
                let (q, q_pos) = (&qc[qi], mine[qi].start);
                let (k, v, k_pos) = (&kc[ki], &vc[ki], theirs[ki].start);
                let (d_o, lse, dd) = (&doc[qi], &lsec[qi], &ddc[qi]);
                let (dq_p, dk_p, dv_p) =
                    match fused::partial_backward(q, q_pos, k, v, k_pos, d_o, lse, dd)? {
                        Some(grads) => grads,
                        None => partial_backward(q, q_pos, k, v, k_pos, d_o, lse, dd, self.blocks)?,
                    };
                for (acc, d) in [
                    (&mut dq[qi], dq_p),
                    (&mut dkc[ki], dk_p),
                    (&mut dvc[ki], dv_p),
                ] {
                    *acc = Some(match acc.take() {
                        None => d,
                        Some(a) => (a + d)?,
                    });
                }
            }
            // This member's share of the held block's gradients, in the owner's local order.
            let share = |parts: [Option<Tensor>; 2]| -> Result<Tensor> {
                let [a, b] = parts;
                let a = a.map_or_else(|| zeros(theirs[0].len()), Ok)?;
                let b = b.map_or_else(|| zeros(theirs[1].len()), Ok)?;
                Ok(Tensor::cat(&[&a, &b], 1)?)
            };
            dk = (dk + share(dkc)?)?;
            dv = (dv + share(dvc)?)?;
            if members == 1 {
                break;
            }
            // Pass the block on with its gradients; the last hop takes only the gradients home.
            let home = step + 1 == members;
            let message = if home {
                vec![dk.clone(), dv.clone()]
            } else {
                vec![held.k.clone(), held.v.clone(), dk.clone(), dv.clone()]
            };
            self.link
                .send(self.next(), self.tag(Pass::Backward, step), message)?;
            let got = self
                .link
                .recv(self.prev(), self.tag(Pass::Backward, step))?;
            let expected = if home { 2 } else { 4 };
            if got.len() != expected {
                return Err(Error::Gang(format!(
                    "member {me}: {} tensors in a backward ring message, expected {expected}",
                    got.len()
                )));
            }
            let mut got = got.into_iter();
            let mut take = || got.next().expect("length checked above");
            if home {
                dk = take();
                dv = take();
            } else {
                held = Held {
                    owner: (held.owner + members - 1) % members,
                    k: take(),
                    v: take(),
                };
                dk = take();
                dv = take();
            }
        }
        let [a, b] = dq;
        let [qa, qb] = &qc;
        let a = a.map_or_else(|| Tensor::zeros(qa.dims(), DType::F32, q.device()), Ok)?;
        let b = b.map_or_else(|| Tensor::zeros(qb.dims(), DType::F32, q.device()), Ok)?;
        Ok((Tensor::cat(&[&a, &b], 1)?, dk, dv))
    }
}

/// The graph node of [`gang_attend`]: its forward hands candle the precomputed output, its
/// backward is the backward ring.
struct GangAttention {
    ring: Ring,
    /// The precomputed output `[1, H, n, hd]`.
    out: Precomputed,
    /// fp32 `[H, n]`: each row's log-sum-exp over the whole sample's visible keys.
    lse: Tensor,
}

impl CustomOp3 for GangAttention {
    fn name(&self) -> &'static str {
        "gang-ring-attention"
    }

    precomputed_forwards!(3);

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let detached = |x: &Tensor| x.detach().get(0);
        let (dq, dk, dv) = self
            .ring
            .guard(|| {
                self.ring.backward(
                    &detached(q)?,
                    &detached(k)?,
                    &detached(v)?,
                    &detached(out)?,
                    &detached(grad_out)?,
                    &self.lse,
                )
            })
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let back = |x: Tensor, like: &Tensor| x.to_dtype(like.dtype())?.unsqueeze(0);
        Ok((Some(back(dq, q)?), Some(back(dk, k)?), Some(back(dv, v)?)))
    }
}
