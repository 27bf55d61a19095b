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
//! - **I2**: a discarded attempt discards the relays with the accumulators ([`Relays::discard`]),
//!   and a flush of an attempt whose owners have moved on is refused by their epoch fence.
//! - **I6**: the take runs on a blocking thread (the actor's `off_runtime` for shards, here a
//!   `spawn_blocking`), the flush's writes have one deadline.

use std::sync::Arc;
use std::time::Duration;

use odc_transport::{codec, AccumulatorRegion, Transport, WriteGuard, WriteTag};

use crate::datapath::{micro_batch_of, transfer};
use crate::directory::ShardRoute;
use crate::error::{Error, Result};
use crate::messages::{OpenRelaysCmd, RelayRoute};
use crate::policy::relay::{Combined, RelayPlan};
use crate::policy::token::JobKey;

/// One relay: the owner's route it flushes into and its own region.
struct Relay {
    target: ShardRoute,
    region: Box<dyn AccumulatorRegion>,
}

/// Every relay of one server (none without relayed pushes).
#[derive(Clone, Default)]
pub(super) struct Relays {
    relays: Arc<Vec<Relay>>,
    chunk_elems: usize,
}

/// What one take gives: the sums a flush sends (each relay's target and its sum, none all
/// zeros) and what every relay combined.
pub(super) struct Taken {
    pub(super) sums: Vec<(ShardRoute, Vec<f32>)>,
    pub(super) combined: Vec<Combined>,
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
            relays.push(Relay { target, region });
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

    /// Every relay of `server` moved to `next_epoch` (run it on a blocking thread): what each
    /// combined, and each sum that is not all zeros. A sum of zeros (no trainer of the node
    /// pushed it, or what they pushed cancelled exactly) would add nothing at its owner, so it
    /// does not cross the NIC; what it combined is still reported.
    pub(super) fn take(&self, server: u32, next_epoch: u64) -> Result<Taken> {
        let mut taken = Taken {
            sums: Vec::new(),
            combined: Vec::with_capacity(self.relays.len()),
        };
        for r in self.relays.iter() {
            let applied = r.region.take_applied(next_epoch)?;
            // Ascending write ids, the micro-batch in their top bits: ascending micro-batches.
            let mut micro_batches: Vec<u32> = applied
                .write_ids
                .iter()
                .map(|id| micro_batch_of(*id))
                .collect();
            micro_batches.dedup();
            taken.combined.push(Combined {
                server,
                unit: r.target.unit,
                owner: r.target.owner,
                micro_batches,
            });
            if applied.values.iter().any(|v| *v != 0.0) {
                taken.sums.push((r.target.clone(), applied.values));
            }
        }
        Ok(taken)
    }

    /// Drop every relay's values, moving it to `next_epoch`.
    pub(super) fn discard(&self, next_epoch: u64) {
        for relay in self.relays.iter() {
            drop(relay.region.take(next_epoch));
        }
    }

    /// The chunk size of this server's flushes.
    pub(super) fn chunk_elems(&self) -> usize {
        self.chunk_elems
    }
}

/// Add every taken sum into its owner's accumulator under `epoch` (see the module docs); the
/// bytes sent once every owner acknowledged.
pub(super) async fn flush(
    transport: Arc<dyn Transport>,
    endpoint: u32,
    key: JobKey,
    taken: Vec<(ShardRoute, Vec<f32>)>,
    chunk_elems: usize,
    epoch: u64,
    timeout: Duration,
) -> Result<u64> {
    let deadline = odc_transport::now() + timeout;
    let micro_batch = RelayPlan::flush_micro_batch(endpoint);
    let token = key.token(epoch, micro_batch);
    let mut sends = Vec::with_capacity(taken.len());
    for (target, sum) in &taken {
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
        let transport = transport.clone();
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
