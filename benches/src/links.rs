//! A transport wrapper that puts a job's transfers on a modelled cluster: nodes × GPUs with NVLink
//! inside a node and a NIC per GPU across nodes ([`sim::topology`](crate::sim::topology)), each
//! transfer queued on the ports of the devices it leaves and enters
//! ([`sim::ports`](crate::sim::ports)). Real bytes still move through the wrapped transport, so
//! contents and the transport contract (C1–C8) are the inner backend's; only time is modelled.
//!
//! # Where bytes are
//!
//! - Trainer `t` runs on device `t` (its view comes from [`Links::view`], given to the job with
//!   `JobBuilder::trainer_transport`); servers and the supervisor use an unpriced view.
//! - Shard server `s` of `K` devices per server holds the shards of devices `sK .. sK + K`: its
//!   region of `L` elements is striped, stripe `j` (`shard_range(L, K, j)`) on device `sK + j`.
//!   With `K` = 1 every device hosts its own server, as in FSDP and ODC; a larger `K` keeps the
//!   same modelled placement and only cuts the simulation's cost (fewer regions, fewer reads).
//!   When the device count divides the unit's elements (powers of two up to 16,384 with the
//!   benchmark's units), a collective trainer's own piece is exactly its own device's stripe, so
//!   the collective pays nothing to read its piece or to write back its reduced piece, as FSDP
//!   does not.
//! - A trainer's inbox (ring messages) is on its own device.
//!
//! # What a transfer costs
//!
//! A read costs its pieces from the owning devices to the reader; an accumulate, the reader's
//! pieces to the owning devices; a send (a collective's ring message), one piece from the sender
//! to the inbox's device, striped over every NIC of the node when it crosses nodes: NCCL runs one
//! ring channel per NIC, each crossing between nodes on its own rail, so a ring's inter-node
//! bandwidth is the node's, not one GPU's (the baseline at its best). Bytes
//! are the real bytes times [`LinksConfig::bytes_scale`] (modelled parameters per emulated
//! element: the emulated units hold thousands of elements where the modelled layers hold
//! hundreds of millions), so pull precision (the published dtype) and fp32 gradients price as
//! they would. A transfer waits at the clock's [`Pace`] until its modelled finish, stretched by
//! the clock's dilation.
//!
//! Deadlines (C6), as [`Throttled`](odc::transport::throttle::Throttled): an operation past its
//! deadline is refused before it reserves a port; one whose modelled finish lies past its deadline
//! waits until the deadline and fails with [`TransportError::DeadlineExceeded`] (an accumulate or
//! a send is then not applied).
//!
//! Not modelled here: control messages (dispatch, reports, the barrier) cross the actors'
//! mailboxes at no modelled cost; [`crate::sim::topology::Topology::barrier_s`] prices them (tens
//! of microseconds against steps of seconds).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use odc::layout::shard_range;
use odc::sim::clock::ClockMode;
use odc::sim::TRAINER_ENDPOINT_BASE;
use odc::transport::priced::{Priced, Pricer};
use odc::transport::throttle::Pace;
use odc::transport::wrap::Wrapped;
use odc::transport::{now, EndpointId, RegionHandle, Transport};
use parking_lot::Mutex;

use crate::sim::ports::{CopyKey, Piece, Ports};
use crate::sim::topology::{Routing, Topology, TopologyError};

/// The modelled cluster of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct LinksConfig {
    /// GPUs per node (fewer when the run has fewer devices).
    pub gpus_per_node: u32,
    pub routing: Routing,
    /// ODC's hierarchical partitioning: a per-node copy of what was pulled.
    pub hpz: bool,
    /// Modelled bytes per real byte moved.
    pub bytes_scale: f64,
    /// Gradient pushes relayed through the node (`JobBuilder::relay_pushes`): a trainer's
    /// pushes stay in its node, each node's relays cross once per step.
    pub relay: bool,
}

/// The shared state of every view: the ports and the mapping of endpoints to devices.
pub struct Links {
    inner: Arc<dyn Transport>,
    ports: Mutex<Ports>,
    hpz: bool,
    gpus_per_node: u32,
    bytes_scale: f64,
    devices: u32,
    devices_per_server: u32,
    /// tokio's clock when the links were made: modelled time 0.
    origin: Instant,
    dilation: f64,
    pace: Pace,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links")
            .field("inner", &self.inner.backend())
            .field("devices", &self.devices)
            .field("devices_per_server", &self.devices_per_server)
            .field("hpz", &self.hpz)
            .field("bytes_scale", &self.bytes_scale)
            .finish()
    }
}

impl Links {
    /// `devices` H100s in nodes of `config.gpus_per_node` (see [`Topology::h100`]) over `inner`,
    /// timed on `clock` (make it on the runtime whose clock it reads).
    pub fn new(
        inner: Arc<dyn Transport>,
        config: &LinksConfig,
        devices: u32,
        devices_per_server: u32,
        clock: ClockMode,
    ) -> Result<Arc<Self>, TopologyError> {
        let g = config.gpus_per_node.clamp(1, devices.max(1));
        let topology = Topology::h100(devices.max(1).div_ceil(g), g)?;
        Ok(Arc::new(Links {
            inner,
            ports: Mutex::new(Ports::new(topology, config.routing)?),
            hpz: config.hpz,
            gpus_per_node: g,
            bytes_scale: if config.bytes_scale.is_finite() && config.bytes_scale > 0.0 {
                config.bytes_scale
            } else {
                1.0
            },
            devices: devices.max(1),
            devices_per_server: devices_per_server.max(1),
            origin: now(),
            dilation: f64::from(clock.dilation()),
            pace: clock.pace(),
        }))
    }

    /// The transport of a trainer on `device`, or (`None`) an unpriced one for servers, the
    /// supervisor and the job's own reads.
    pub fn view(self: &Arc<Self>, device: Option<u32>) -> Arc<dyn Transport> {
        self.priced(device.map_or(Source::Unpriced, Source::Device))
    }

    /// The transport shard server `server` flushes its relays through: each stripe of a relay
    /// leaves from the server's device on the owner's stripe's rail (its position in its node).
    pub fn server_view(self: &Arc<Self>, server: u32) -> Arc<dyn Transport> {
        self.priced(Source::Server(server))
    }

    fn priced(self: &Arc<Self>, source: Source) -> Arc<dyn Transport> {
        Arc::new(Wrapped(Priced::new(
            Arc::clone(&self.inner),
            DevicePricer {
                links: Arc::clone(self),
                source,
            },
        )))
    }

    /// The devices of server `server`: its first and how many.
    fn server_devices(&self, server: EndpointId) -> (u32, u32) {
        let first = server.saturating_mul(self.devices_per_server);
        let k = self
            .devices
            .saturating_sub(first)
            .clamp(1, self.devices_per_server);
        (first.min(self.devices - 1), k)
    }

    /// Modelled seconds since the origin.
    fn now_s(&self) -> f64 {
        now().saturating_duration_since(self.origin).as_secs_f64() / self.dilation
    }

    /// tokio's instant of modelled time `s`.
    fn instant(&self, s: f64) -> Instant {
        let d = Duration::try_from_secs_f64(s * self.dilation).unwrap_or(Duration::MAX);
        self.origin.checked_add(d).unwrap_or(self.origin)
    }

    /// Modelled bytes of `elems` elements of `size` bytes.
    fn bytes(&self, elems: u64, size: usize) -> u64 {
        (elems as f64 * size as f64 * self.bytes_scale).round() as u64
    }

    /// The devices holding `range` of a region of `len` elements owned by `owner`, with how many
    /// of its elements each holds (see the module docs).
    fn holders(&self, owner: EndpointId, len: u64, range: Range<u64>) -> Vec<(u32, u64)> {
        if owner >= TRAINER_ENDPOINT_BASE {
            let device = (owner - TRAINER_ENDPOINT_BASE).min(self.devices - 1);
            return vec![(device, range.end.saturating_sub(range.start))];
        }
        let (first, k) = self.server_devices(owner);
        (0..k)
            .filter_map(|j| {
                let stripe = shard_range(len as usize, k as usize, j as usize);
                let lo = range.start.max(stripe.start as u64);
                let hi = range.end.min(stripe.end as u64);
                (hi > lo).then(|| ((first + j).min(self.devices - 1), hi - lo))
            })
            .collect()
    }

    /// Schedule pieces now: a read (HPZ-aware), a write, or a ring message (striped over the
    /// node's NICs, as NCCL's one channel per NIC spreads a ring's node crossings over every rail).
    /// A topology error (a device outside it) is a bug of the mapping above and costs nothing
    /// rather than failing the job's transfer.
    fn schedule(&self, kind: Kind, pieces: &[Piece]) -> f64 {
        let at = self.now_s();
        let mut ports = self.ports.lock();
        let done = match kind {
            Kind::Read { reader, hpz } => ports.read(reader, pieces, hpz, at),
            Kind::Write => ports.transfer(pieces, at),
            Kind::Ring => ports.transfer_routed(pieces, at, Routing::Striped),
        };
        done.unwrap_or_else(|e| {
            tracing::warn!("links: {e}; transfer not priced");
            at
        })
    }
}

/// What a scheduled transfer is.
enum Kind {
    Read { reader: u32, hpz: Option<CopyKey> },
    Write,
    Ring,
}

/// Where a view's transfers leave from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// Servers' and the supervisor's own calls, the job's reads: free.
    Unpriced,
    /// A trainer's device.
    Device(u32),
    /// A shard server flushing its relays (its reads are free).
    Server(u32),
}

/// One view's pricing of the [`Links`], for the one priced wrapper.
#[derive(Debug)]
struct DevicePricer {
    links: Arc<Links>,
    source: Source,
}

impl DevicePricer {
    fn device(&self) -> Option<u32> {
        match self.source {
            Source::Device(d) => Some(d),
            Source::Unpriced | Source::Server(_) => None,
        }
    }
}

impl Pricer for DevicePricer {
    fn pace(&self) -> Pace {
        self.links.pace
    }

    fn read(&self, handle: &RegionHandle, range: Range<usize>, version: u64) -> Option<Instant> {
        let reader = self.device()?;
        let f = &self.links;
        let (start, end) = (range.start as u64, range.end as u64);
        let size = handle.dtype.size();
        let pieces: Vec<Piece> = f
            .holders(handle.owner, handle.len, start..end)
            .into_iter()
            .map(|(src, elems)| Piece {
                src,
                dst: reader,
                bytes: f.bytes(elems, size),
            })
            .collect();
        let hpz = f.hpz.then_some(CopyKey {
            node: reader / f.gpus_per_node,
            owner: handle.owner,
            region: handle.id,
            start,
            end,
            version,
        });
        Some(f.instant(f.schedule(Kind::Read { reader, hpz }, &pieces)))
    }

    fn accumulate(&self, handle: &RegionHandle, offset: usize, bytes: usize) -> Option<Instant> {
        let f = &self.links;
        let src = |dst: u32| match self.source {
            Source::Device(writer) => Some(writer),
            // The relay's stripe on the owner's stripe's rail.
            Source::Server(server) => {
                let ((first, k), (owner_first, _)) =
                    (f.server_devices(server), f.server_devices(handle.owner));
                Some(first + dst.saturating_sub(owner_first) % k)
            }
            Source::Unpriced => None,
        };
        let elems = (bytes / 4) as u64;
        let start = offset as u64;
        let pieces: Vec<Piece> = f
            .holders(handle.owner, handle.len, start..start.saturating_add(elems))
            .into_iter()
            .map(|(dst, elems)| {
                Some(Piece {
                    src: src(dst)?,
                    dst,
                    bytes: f.bytes(elems, 4),
                })
            })
            .collect::<Option<_>>()?;
        Some(f.instant(f.schedule(Kind::Write, &pieces)))
    }

    fn send(&self, inbox: &RegionHandle, bytes: usize) -> Option<Instant> {
        let sender = self.device()?;
        let f = &self.links;
        let (dst, _) = f
            .holders(inbox.owner, 0, 0..0)
            .first()
            .copied()
            .unwrap_or((sender, 0));
        let piece = Piece {
            src: sender,
            dst,
            bytes: f.bytes(bytes as u64, 1),
        };
        Some(f.instant(f.schedule(Kind::Ring, &[piece])))
    }
}

impl LinksConfig {
    /// Modelled seconds one micro-batch's transfers occupy a trainer of `devices` when every
    /// trainer does the same, for a model of `elems` elements pulled at `pull_bytes` and pushed
    /// at `push_bytes` bytes per element (real bytes; [`LinksConfig::bytes_scale`] applies): the
    /// dispatcher's price of a micro-batch's communication
    /// ([`CostModel::transfer`](odc::CostModel)).
    ///
    /// - **Pushes** leave on the trainer's egress: `(d − g)/d` of the model to owners in other
    ///   nodes (striped over the node's NICs, which its `g` trainers share: one NIC's worth
    ///   each) and `(g − 1)/d` over NVLink; the slower of the two. With relays
    ///   ([`LinksConfig::relay`]) every push stays in the node: `(g − 1)/g` of it over NVLink
    ///   (the relays' flushes cross once per step, at the barrier, not per micro-batch).
    /// - **Pulls** arrive on its ingress: without HPZ as the pushes; with HPZ the node's copy
    ///   crosses the NICs once (`1/g` of the remote part per GPU) and every trainer reads
    ///   `(g − 1)/g` of it over NVLink.
    ///
    /// Pulls and pushes use opposite directions of the ports: the price is the larger. A
    /// steady-state average, not a schedule: bursts and the first and last units' exposure are
    /// [`crate::sim::ports`]'s.
    pub fn transfer_s(
        &self,
        devices: u32,
        elems: u64,
        pull_bytes: usize,
        push_bytes: usize,
    ) -> Result<f64, TopologyError> {
        let d = devices.max(1);
        let g = self.gpus_per_node.clamp(1, d);
        let t = Topology::h100(d.div_ceil(g), g)?;
        let scale = if self.bytes_scale.is_finite() && self.bytes_scale > 0.0 {
            self.bytes_scale
        } else {
            1.0
        };
        let (df, gf) = (f64::from(d), f64::from(g));
        let remote = (df - gf) / df;
        let bytes = |per_elem: usize| elems as f64 * per_elem as f64 * scale;
        let spread = |b: f64| {
            (remote * b / t.nic.bytes_per_s).max((gf - 1.0) / df * b / t.nvlink.bytes_per_s)
        };
        let push = if self.relay {
            (gf - 1.0) / gf * bytes(push_bytes) / t.nvlink.bytes_per_s
        } else {
            spread(bytes(push_bytes))
        };
        let pull = if self.hpz {
            let b = bytes(pull_bytes);
            (remote * b / gf / t.nic.bytes_per_s).max((gf - 1.0) / gf * b / t.nvlink.bytes_per_s)
        } else {
            spread(bytes(pull_bytes))
        };
        Ok(push.max(pull))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use odc::transport::local::LocalTransport;

    #[test]
    fn a_micro_batchs_transfers_are_priced_by_the_slower_direction() {
        let mut config = LinksConfig {
            gpus_per_node: 8,
            routing: Routing::Striped,
            hpz: true,
            bytes_scale: 1.0,
            relay: false,
        };
        // 7B-like: 1e9 elements, bf16 pulls, fp32 pushes, 64 devices: the pushes send 7/8 of
        // 4 GB over one NIC's worth (50 GB/s).
        let t = config.transfer_s(64, 1_000_000_000, 2, 4).unwrap();
        assert!((t - 4e9 * 56.0 / 64.0 / 50e9).abs() < 1e-9, "{t}");
        // One node: everything over NVLink, 7/8 of the pushes.
        let one = config.transfer_s(8, 1_000_000_000, 2, 4).unwrap();
        assert!((one - 4e9 * 7.0 / 8.0 / 450e9).abs() < 1e-12, "{one}");
        // Without HPZ, fp32 pulls cost what the pushes do.
        config.hpz = false;
        let plain = config.transfer_s(64, 1_000_000_000, 4, 4).unwrap();
        assert!((plain - t).abs() < 1e-12);
        // Relayed: the pushes stay on NVLink, 7/8 of them; bf16 pulls with HPZ are then the
        // slower direction (1/8 of the remote 7/8 of 2 GB over the NIC).
        config.hpz = true;
        config.relay = true;
        let relayed = config.transfer_s(64, 1_000_000_000, 2, 4).unwrap();
        let pull: f64 = 2e9 * 56.0 / 64.0 / 8.0 / 50e9;
        assert!(
            (relayed - pull.max(4e9 * 7.0 / 8.0 / 450e9)).abs() < 1e-12,
            "{relayed}"
        );
        assert!(relayed < t / 4.0, "{relayed} vs {t}");
        config.relay = false;
        config.gpus_per_node = 0;
        assert!(config.transfer_s(0, 1, 2, 4).unwrap().is_finite());
    }

    fn links(devices: u32, per_server: u32) -> Arc<Links> {
        let config = LinksConfig {
            gpus_per_node: 8,
            routing: Routing::Direct,
            hpz: false,
            bytes_scale: 2.0,
            relay: false,
        };
        let local: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        Links::new(local, &config, devices, per_server, ClockMode::Virtual).unwrap()
    }

    #[tokio::test]
    async fn a_servers_region_is_striped_over_its_devices_and_a_trainer_is_its_own() {
        let f = links(16, 4);
        // Server 1 holds devices 4..8; 100 elements in stripes of 25.
        assert_eq!(
            f.holders(1, 100, 0..100),
            vec![(4, 25), (5, 25), (6, 25), (7, 25)]
        );
        assert_eq!(f.holders(1, 100, 20..30), vec![(4, 5), (5, 5)]);
        assert_eq!(f.holders(1, 100, 30..30), vec![]);
        assert_eq!(f.holders(TRAINER_ENDPOINT_BASE + 9, 0, 0..7), vec![(9, 7)]);
        // A server past the devices maps onto the last one instead of panicking.
        assert_eq!(f.holders(99, 10, 0..10), vec![(15, 10)]);
        assert_eq!(
            f.bytes(10, 2),
            40,
            "10 bf16 elements at 2 modelled bytes per byte"
        );
    }

    #[tokio::test]
    async fn a_partial_node_and_a_bad_scale_are_accepted() {
        let config = LinksConfig {
            gpus_per_node: 8,
            routing: Routing::Striped,
            hpz: true,
            bytes_scale: f64::NAN,
            relay: false,
        };
        let local: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let f = Links::new(local, &config, 12, 1, ClockMode::Virtual).unwrap();
        assert_eq!(f.bytes(3, 4), 12, "a non-finite scale counts real bytes");
        assert_eq!(f.holders(11, 8, 0..8), vec![(11, 8)]);
    }
}
