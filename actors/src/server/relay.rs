//! A shard server's relays: node-local accumulators for owners on other nodes
//! ([`crate::policy::relay`]).
//!
//! - A relay is an fp32 accumulator region of exactly its owner's shard's length, registered with
//!   this process's transport and guarded by the same admission as the server's own accumulators
//!   (epoch fence, write ids, the assignment's token: transport C3, C8). A trainer's write into
//!   it is the write it would have made into the owner's accumulator, only addressed to its node:
//!   so a late, duplicated or forged write is refused here exactly as the owner would refuse it.
//! - [`Relays::take`] moves every relay to the next epoch atomically and returns its sum and
//!   the micro-batches whose writes it applied (from their write ids: transport
//!   `take_applied`); [`flush`] adds each sum into its owner's accumulator under the flushed
//!   epoch, in chunks, each write id `(relay micro-batch of this server, unit, owner, chunk)`
//!   and the token of that relay micro-batch (`RelayPlan::flush_micro_batch`), which the owner's
//!   admission checks like any other. A sum of zeros is not sent (it would add nothing).
//! - **The ledger's count travels with the flush**: the server's reply names what every relay
//!   combined ([`Combined`]), and the supervisor checks it against the ledger before any owner
//!   reduces (`RelayPlan::check_combined`); a disagreement discards the attempt and replays it.
//! - **Early flushes** ([`Relays::expect`]): with a static plan the supervisor says, as an
//!   attempt starts, how many micro-batches this server's node runs. A relay whose region has
//!   applied all their writes (each micro-batch writes every chunk of the shard once: transport
//!   `progress`) flushes at once, while other nodes still compute, so the barrier waits only for
//!   the last ones. Exactly one of the early flush and the barrier's takes a relay's sum of an
//!   epoch (its claim, under one lock with the take and with the discard); the barrier then
//!   collects the early flush's outcome and reports what it combined with the rest.
//! - **I2**: a discarded attempt discards the relays with the accumulators ([`Relays::discard`]),
//!   and a flush of an attempt whose owners have moved on is refused by their epoch fence. An
//!   early flush takes a relay only while its region is still in the expected epoch, so it never
//!   takes a replay's writes.
//! - **I6**: the take runs on a blocking thread (the actor's `off_runtime` for shards, here a
//!   `spawn_blocking`), the flush's writes have one deadline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc_transport::{chunk_ranges, codec, AccumulatorRegion, Transport, WriteGuard, WriteTag};
use tokio::sync::oneshot;

use crate::datapath::{micro_batch_of, transfer};
use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::policy::relay::{Combined, RelayPlan};
use crate::policy::token::JobKey;
use crate::server::messages::{ExpectRelaysCmd, OpenRelaysCmd, RelayRoute};

/// One relay: the owner's route it flushes into, its own region and who took its sum.
struct Relay {
    target: ShardRoute,
    region: Box<dyn AccumulatorRegion>,
    claim: Mutex<Claim>,
}

/// Who took a relay's sum of which epoch.
enum Claim {
    /// Nobody since the relay opened or was discarded.
    Open,
    /// The barrier's flush.
    Barrier(u64),
    /// An early flush; its outcome (what it combined, once sent) comes on the receiver, which
    /// the barrier takes.
    Early(u64, Option<oneshot::Receiver<Result<Combined>>>),
}

/// What taking one relay gives: what it combined and its sum, unless all zeros.
struct TakenOne {
    combined: Combined,
    sum: Option<(ShardRoute, Vec<f32>)>,
}

impl Relay {
    /// The relay's sum and the micro-batches it combined, moving it to `next_epoch` (its claim's
    /// lock held by the caller).
    fn take(&self, server: u32, next_epoch: u64) -> Result<TakenOne> {
        let applied = self.region.take_applied(next_epoch)?;
        // Ascending write ids, the micro-batch in their top bits: ascending micro-batches.
        let mut micro_batches: Vec<u32> = applied
            .write_ids
            .iter()
            .map(|id| micro_batch_of(*id))
            .collect();
        micro_batches.dedup();
        let combined = Combined {
            server,
            unit: self.target.unit,
            owner: self.target.owner,
            micro_batches,
            early: false,
        };
        let sum = applied
            .values
            .iter()
            .any(|v| *v != 0.0)
            .then(|| (self.target.clone(), applied.values));
        Ok(TakenOne { combined, sum })
    }
}

/// Every relay of one server (none without relayed pushes).
#[derive(Clone, Default)]
pub(super) struct Relays {
    relays: Arc<Vec<Relay>>,
    chunk_elems: usize,
}

/// What the barrier's take gives: the sums it sends itself (none all zeros), what those relays
/// combined, and the outcomes of the relays an early flush took.
pub(super) struct Taken {
    pub(super) sums: Vec<(ShardRoute, Vec<f32>)>,
    pub(super) combined: Vec<Combined>,
    pub(super) early: Vec<oneshot::Receiver<Result<Combined>>>,
}

/// Where a server's flushes go and under which key: what an early flush needs of its server.
#[derive(Clone)]
pub(super) struct Flusher {
    pub(super) transport: Arc<dyn Transport>,
    pub(super) endpoint: u32,
    pub(super) key: JobKey,
}

impl Relays {
    /// Register a relay for every target with an accumulator, at `epoch`, admitting what
    /// `admission` admits; their routes for the trainers of this server's node.
    pub(super) fn open(
        transport: &dyn Transport,
        endpoint: u32,
        epoch: u64,
        admission: WriteGuard,
        cmd: OpenRelaysCmd,
    ) -> Result<(Self, Vec<RelayRoute>)> {
        if transport.backend() == "cuda" {
            return Err(Error::Config(
                "relayed pushes are not built for the cuda transport yet (device pushes go \
                 straight to the owners' device accumulators)"
                    .into(),
            ));
        }
        let mut relays = Vec::new();
        let mut routes = Vec::new();
        for target in cmd.targets {
            if target.accumulator.is_none() || target.end <= target.start {
                continue;
            }
            let region = transport.register_accumulator(endpoint, target.range().len(), epoch)?;
            region.admit_only(admission.clone())?;
            routes.push(RelayRoute {
                relay: endpoint,
                unit: target.unit,
                owner: target.owner,
                accumulator: region.handle(),
            });
            relays.push(Relay {
                target,
                region,
                claim: Mutex::new(Claim::Open),
            });
        }
        let relays = Relays {
            relays: Arc::new(relays),
            chunk_elems: usize::try_from(cmd.chunk_elems)
                .unwrap_or(usize::MAX)
                .max(1),
        };
        Ok((relays, routes))
    }

    /// Whether this server relays anything.
    pub(super) fn is_empty(&self) -> bool {
        self.relays.is_empty()
    }

    /// The barrier's take of `epoch` (run it on a blocking thread): every relay no early flush
    /// took is moved to `next_epoch` and reported (its sum sent by the caller unless all
    /// zeros, which would add nothing at its owner); an early flush's outcome is handed over.
    pub(super) fn take(&self, server: u32, epoch: u64, next_epoch: u64) -> Result<Taken> {
        let mut taken = Taken {
            sums: Vec::new(),
            combined: Vec::with_capacity(self.relays.len()),
            early: Vec::new(),
        };
        for relay in self.relays.iter() {
            let mut claim = lock(&relay.claim);
            if let Claim::Early(e, outcome) = &mut *claim {
                if *e == epoch {
                    taken.early.extend(outcome.take());
                    continue;
                }
            }
            *claim = Claim::Barrier(epoch);
            let one = relay.take(server, next_epoch)?;
            taken.combined.push(one.combined);
            taken.sums.extend(one.sum);
        }
        Ok(taken)
    }

    /// Drop every relay's values, moving it to `next_epoch`.
    pub(super) fn discard(&self, next_epoch: u64) {
        for relay in self.relays.iter() {
            let mut claim = lock(&relay.claim);
            *claim = Claim::Open;
            drop(relay.region.take(next_epoch));
        }
    }

    /// The chunk size of this server's flushes.
    pub(super) fn chunk_elems(&self) -> usize {
        self.chunk_elems
    }

    /// Flush each relay of this server as soon as its region has applied every write of the
    /// `cmd.micro_batches` micro-batches its node runs in `cmd.epoch` (module docs). Returns at
    /// once. One task waits for all of them (a small future per relay: a server relays every
    /// off-node owner's shard of every unit, thousands at a thousand devices) and starts each
    /// relay's flush as its region completes; a relay that leaves the epoch is given up.
    pub(super) fn expect(&self, flusher: &Flusher, cmd: ExpectRelaysCmd) {
        let epoch = cmd.epoch;
        let mut waits = futures::stream::FuturesUnordered::new();
        for (index, relay) in self.relays.iter().enumerate() {
            let per_micro_batch = chunk_ranges(relay.target.range(), self.chunk_elems).count();
            let want = per_micro_batch.saturating_mul(cmd.micro_batches as usize);
            let Some(mut progress) = relay.region.progress().filter(|_| want > 0) else {
                continue;
            };
            waits.push(async move {
                let ready = progress
                    .wait_for(|now| now.epoch != epoch || now.applied >= want)
                    .await
                    .is_ok_and(|now| now.epoch == epoch);
                (index, ready)
            });
        }
        if waits.is_empty() {
            return;
        }
        let (relays, flusher) = (self.clone(), flusher.clone());
        tokio::spawn(async move {
            use futures::StreamExt;
            while let Some((index, ready)) = waits.next().await {
                if ready {
                    let (relays, flusher) = (relays.clone(), flusher.clone());
                    tokio::spawn(async move { relays.flush_early(index, &flusher, cmd).await });
                }
            }
        });
    }

    /// Relay `index`'s early flush, once its region holds its node's whole sum of `cmd.epoch`
    /// (see [`Relays::expect`]).
    async fn flush_early(self, index: usize, flusher: &Flusher, cmd: ExpectRelaysCmd) {
        let epoch = cmd.epoch;
        let (tx, rx) = oneshot::channel();
        let (relays, server) = (self.clone(), flusher.endpoint);
        let taken = tokio::task::spawn_blocking(move || {
            let relay = &relays.relays[index];
            let mut claim = lock(&relay.claim);
            let claimed = match &*claim {
                Claim::Barrier(e) | Claim::Early(e, _) => *e == epoch,
                Claim::Open => false,
            };
            // A discard moved the region on: its writes are a replay's, not this attempt's.
            if claimed || relay.region.epoch() != epoch {
                return None;
            }
            *claim = Claim::Early(epoch, Some(rx));
            Some(relay.take(server, epoch + 1))
        })
        .await;
        let one = match taken {
            Ok(Some(one)) => one,
            Ok(None) | Err(_) => return,
        };
        let outcome = match one {
            Ok(TakenOne { combined, sum }) => {
                let timeout = Duration::from_millis(cmd.timeout_ms);
                let sums = sum.into_iter().collect();
                flush(flusher, sums, self.chunk_elems, epoch, timeout)
                    .await
                    .map(|()| Combined {
                        early: true,
                        ..combined
                    })
            }
            Err(e) => Err(e),
        };
        if outcome.is_ok() {
            metrics::counter!(crate::metrics::RELAY_EARLY_FLUSHES).increment(1);
        }
        let _ = tx.send(outcome);
    }
}

/// `mutex`'s guard, also after a panic elsewhere (a claim is plain data, consistent at every
/// store).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Add every taken sum into its owner's accumulator under `epoch` (see the module docs); done
/// once every owner acknowledged (the bytes counted in `odc_relay_flushed_bytes_total`).
pub(super) async fn flush(
    flusher: &Flusher,
    taken: Vec<(ShardRoute, Vec<f32>)>,
    chunk_elems: usize,
    epoch: u64,
    timeout: Duration,
) -> Result<()> {
    let endpoint = flusher.endpoint;
    let held = (crate::faults::installed().relay_flush_delay).filter(|_| !taken.is_empty());
    if let Some(delay) = held {
        tracing::warn!(
            "shard server {endpoint}: relay flush of epoch {epoch} held for {} ms \
             (fault injection): its sums are taken, not yet sent",
            delay.as_millis()
        );
        tokio::time::sleep(delay).await;
    }
    let sent = send(flusher, &taken, chunk_elems, epoch, timeout).await;
    if held.is_some() {
        tracing::warn!("shard server {endpoint}: relay flush of epoch {epoch} released: {sent:?}");
    }
    let bytes = sent?;
    metrics::counter!(crate::metrics::RELAY_FLUSHED_BYTES).increment(bytes);
    Ok(())
}

/// [`flush`]'s writes, one batch per relay, all within `timeout`.
async fn send(
    flusher: &Flusher,
    taken: &[(ShardRoute, Vec<f32>)],
    chunk_elems: usize,
    epoch: u64,
    timeout: Duration,
) -> Result<u64> {
    let deadline = odc_transport::now() + timeout;
    let micro_batch = RelayPlan::flush_micro_batch(flusher.endpoint);
    let token = flusher.key.token(epoch, micro_batch);
    let mut sends = Vec::with_capacity(taken.len());
    for (target, sum) in taken {
        let (unit, owner) = (target.unit, target.owner);
        let tag = |_shard: u32, chunk: u32| WriteTag {
            epoch,
            write_id: transfer::write_id(micro_batch, unit, owner, chunk),
            token,
        };
        let range = target.range();
        let writes = match transfer::encode_writes(
            std::slice::from_ref(target),
            range,
            sum,
            tag,
            chunk_elems,
            |values| Ok::<_, std::convert::Infallible>(codec::encode_f32(values)),
        ) {
            Ok(writes) => writes,
            Err((_, never)) => match never {},
        };
        let transport = flusher.transport.clone();
        sends.push(async move {
            transfer::send_writes(transport.as_ref(), unit, writes, deadline).await
        });
    }
    let mut bytes = 0;
    for sent in futures::future::join_all(sends).await {
        bytes += sent?;
    }
    Ok(bytes)
}
