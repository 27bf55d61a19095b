//! The links of a [`Topology`] as an online schedule: the runtime's transfers are priced one by
//! one, in the order they arrive, on the four ports per device of [`Topology::simulate`] (NVLink
//! egress and ingress, NIC egress and ingress), at its bandwidths and latencies.
//!
//! - **Each port is its own FIFO queue, in arrival order.** A hop takes `bytes / bandwidth` of
//!   its source's egress and of its destination's ingress, each queued behind what arrived
//!   earlier on that port, and it finishes a latency after the later of the two. A port never
//!   serves two transfers at once and never idles while a transfer waits for it.
//!   [`Topology::simulate`] instead holds both ports at once. It can reorder by readiness; an
//!   online schedule cannot, and holding both ports in arrival order leaves holes that no real
//!   NIC leaves. Under many-to-many load (every trainer pulling from every owner) that rule cut
//!   on-demand's utilisation to a third in a first try. Decoupled ports charge every port its
//!   full load and no more: a fluid approximation, optimistic for a transfer whose two ports are
//!   busy at different times.
//! - **Readiness.** A later hop of a routed transfer, or a read of an HPZ copy still in flight,
//!   is queued when the transfer arrives, but cannot finish before its bytes are there plus its
//!   own serialisation.
//! - **Pieces.** A transfer from a shard server striped over several devices is one piece per
//!   owning device, and it finishes when its last piece does. A piece from a device to itself is
//!   free.
//! - **Routing.** [`Routing::Striped`] sends a cross-node piece as one stripe per GPU of the node,
//!   through proxies: source → proxy `j` over NVLink, proxy → GPU `j` of the other node over its
//!   NIC, then → destination over NVLink.
//! - **HPZ** ([`Ports::read`] with a [`CopyKey`]): the first read of a published range (at one
//!   version) by a device of a node leaves a copy in that node, spread over its GPUs. Each remote
//!   piece lands on the node's GPU of the source's rail (over the NIC), then crosses NVLink to the
//!   reader. Every later read of it in the node waits for the copy and takes `1/G` of it from
//!   each GPU of the node over NVLink. The copy's memory is not modelled.
//!
//! Guarantees: pure (no clock: the caller passes arrival times in modelled seconds);
//! deterministic for the same arrivals; a finish time is never before its arrival; a device
//! outside the topology is a [`TopologyError`], not a panic.

use std::collections::HashMap;

use super::topology::{Routing, Topology, TopologyError};

/// A published range at one version, as seen from one node: what an HPZ copy holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyKey {
    pub node: u32,
    pub owner: u32,
    pub region: u64,
    pub start: u64,
    pub end: u64,
    pub version: u64,
}

/// One piece of a transfer: `bytes` from device `src` to device `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub src: u32,
    pub dst: u32,
    pub bytes: u64,
}

/// See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Ports {
    topology: Topology,
    routing: Routing,
    /// Per device: NVLink egress, NVLink ingress, NIC egress, NIC ingress free times.
    free: Vec<[f64; 4]>,
    /// HPZ copies: when each node's copy of a range is ready.
    copies: HashMap<CopyKey, f64>,
}

impl Ports {
    /// Idle ports on every device of `topology` (checked).
    pub fn new(topology: Topology, routing: Routing) -> Result<Self, TopologyError> {
        topology.validate()?;
        let devices = topology.devices() as usize;
        Ok(Ports {
            topology,
            routing,
            free: vec![[0.0; 4]; devices],
            copies: HashMap::new(),
        })
    }

    /// Schedule `pieces` arriving at `at` (modelled seconds), routed by the schedule's routing;
    /// returns when the last finishes (`at` for none).
    pub fn transfer(&mut self, pieces: &[Piece], at: f64) -> Result<f64, TopologyError> {
        self.transfer_routed(pieces, at, self.routing)
    }

    /// [`Ports::transfer`] with `routing` for these pieces.
    pub fn transfer_routed(
        &mut self,
        pieces: &[Piece],
        at: f64,
        routing: Routing,
    ) -> Result<f64, TopologyError> {
        self.check(pieces)?;
        let at = if at.is_finite() { at.max(0.0) } else { 0.0 };
        Ok(self.schedule(pieces, at, at, Some(routing)))
    }

    /// Checked `pieces` arriving at `arrival` whose bytes are ready at `ready`, routed by
    /// `routing`, or (`None`) to the HPZ holder on the destination node's rail of the source.
    fn schedule(
        &mut self,
        pieces: &[Piece],
        arrival: f64,
        ready: f64,
        routing: Option<Routing>,
    ) -> f64 {
        let mut done = ready;
        for &p in pieces {
            let finish = match routing {
                Some(routing) => self.routed(p, arrival, ready, routing),
                None => self.via_holder(p, arrival, ready),
            };
            done = done.max(finish);
        }
        done
    }

    /// A read of `pieces` by device `reader` arriving at `at`; with `hpz` (the range's key in
    /// the reader's node) from the node's copy where one exists (see the module docs).
    pub fn read(
        &mut self,
        reader: u32,
        pieces: &[Piece],
        hpz: Option<CopyKey>,
        at: f64,
    ) -> Result<f64, TopologyError> {
        let Some(key) = hpz else {
            return self.transfer(pieces, at);
        };
        let at = if at.is_finite() { at.max(0.0) } else { 0.0 };
        let Some(&ready) = self.copies.get(&key) else {
            self.check(pieces)?;
            let done = self.schedule(pieces, at, at, None);
            self.copies.insert(key, done);
            return Ok(done);
        };
        let g = self.topology.gpus_per_node;
        let base = self.topology.node_of(reader) * g;
        let total: u64 = pieces.iter().map(|p| p.bytes).sum();
        let stripes: Vec<Piece> = (0..g)
            .map(|j| Piece {
                src: base + j,
                dst: reader,
                bytes: total / u64::from(g) + u64::from(u64::from(j) < total % u64::from(g)),
            })
            .collect();
        self.check(&stripes)?;
        Ok(self.schedule(&stripes, at, at.max(ready), Some(Routing::Direct)))
    }

    /// A device outside the topology is an error.
    fn check(&self, pieces: &[Piece]) -> Result<(), TopologyError> {
        let n = self.topology.devices();
        for (i, p) in pieces.iter().enumerate() {
            if let Some(device) = [p.src, p.dst].into_iter().find(|&d| d >= n) {
                return Err(TopologyError::NoDevice {
                    transfer: i,
                    device,
                    devices: n,
                });
            }
        }
        Ok(())
    }

    /// HPZ's first fetch of a piece: across nodes it lands on the destination node's GPU of the
    /// source's rail (the holder of that owner's shards), then crosses NVLink to the reader; the
    /// node's copy is thereby spread over its GPUs and its NICs.
    fn via_holder(&mut self, p: Piece, arrival: f64, ready: f64) -> f64 {
        let t = &self.topology;
        let g = t.gpus_per_node;
        if t.node_of(p.src) == t.node_of(p.dst) {
            return self.hop(p.src, p.dst, p.bytes, arrival, ready);
        }
        let holder = t.node_of(p.dst) * g + p.src % g;
        let landed = self.hop(p.src, holder, p.bytes, arrival, ready);
        self.hop(holder, p.dst, p.bytes, arrival, landed)
    }

    /// One hop of a checked piece that arrived at `arrival` and whose bytes are at `src` from
    /// `ready` on: each port queues it in arrival order, and it finishes a latency after the later
    /// of the two ports is through with it, and not before its bytes could have crossed (see the
    /// module docs).
    fn hop(&mut self, src: u32, dst: u32, bytes: u64, arrival: f64, ready: f64) -> f64 {
        if src == dst {
            return ready;
        }
        let t = &self.topology;
        let (out, inp, link) = if t.node_of(src) == t.node_of(dst) {
            (0, 1, t.nvlink)
        } else {
            (2, 3, t.nic)
        };
        let busy = link.serialize_s(bytes);
        let egress = &mut self.free[src as usize][out];
        *egress = egress.max(arrival) + busy;
        let sent = *egress;
        let ingress = &mut self.free[dst as usize][inp];
        *ingress = ingress.max(arrival) + busy;
        sent.max(*ingress).max(ready + busy) + link.latency_s
    }

    /// One checked piece, routed.
    fn routed(&mut self, p: Piece, arrival: f64, ready: f64, routing: Routing) -> f64 {
        let t = &self.topology;
        let (a, b) = (t.node_of(p.src), t.node_of(p.dst));
        if a == b || routing == Routing::Direct {
            return self.hop(p.src, p.dst, p.bytes, arrival, ready);
        }
        let g = t.gpus_per_node;
        let mut done = ready;
        for j in 0..g {
            let bytes = p.bytes / u64::from(g) + u64::from(u64::from(j) < p.bytes % u64::from(g));
            let (pa, pb) = (a * g + j, b * g + j);
            let mut at = ready;
            for (src, dst) in [(p.src, pa), (pa, pb), (pb, p.dst)] {
                at = self.hop(src, dst, bytes, arrival, at);
            }
            done = done.max(at);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::topology::Transfer;

    fn piece(src: u32, dst: u32, bytes: u64) -> Piece {
        Piece { src, dst, bytes }
    }

    fn close(a: f64, b: f64) -> bool {
        a.is_finite() && b.is_finite() && (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn one_piece_costs_its_link_like_the_offline_simulation() {
        let t = Topology::h100(2, 4).unwrap();
        let mut ports = Ports::new(t.clone(), Routing::Direct).unwrap();
        for (src, dst) in [(0, 1), (0, 5)] {
            let online = ports.transfer(&[piece(src, dst, 1 << 20)], 1.0).unwrap();
            let offline = t
                .simulate(&[Transfer::new(src, dst, 1 << 20, 1.0)], Routing::Direct)
                .unwrap()[0];
            assert!(close(online, offline), "{online} vs {offline}");
            assert!(close(online, 1.0 + t.link(src, dst).message_s(1 << 20)));
        }
    }

    #[test]
    fn arrivals_on_one_port_queue_fifo_and_other_ports_overlap() {
        let t = Topology::h100(2, 4).unwrap();
        let mut ports = Ports::new(t.clone(), Routing::Direct).unwrap();
        let b = 50_000_000; // 1 ms on a NIC
        let first = ports.transfer(&[piece(4, 0, b)], 0.0).unwrap();
        let second = ports.transfer(&[piece(5, 0, b)], 0.0).unwrap();
        let other = ports.transfer(&[piece(6, 1, b)], 0.0).unwrap();
        let serialize = t.nic.serialize_s(b);
        assert!(close(second - first, serialize), "same ingress: queued");
        assert!(close(other, first), "another device's ports: overlapped");
    }

    #[test]
    fn pieces_from_a_striped_server_share_the_readers_ingress() {
        let t = Topology::h100(2, 4).unwrap();
        let mut ports = Ports::new(t.clone(), Routing::Direct).unwrap();
        let pieces: Vec<Piece> = (4..8).map(|s| piece(s, 0, 1_000_000)).collect();
        let done = ports.transfer(&pieces, 0.0).unwrap();
        assert!(close(
            done,
            4.0 * t.nic.serialize_s(1_000_000) + t.nic.latency_s
        ));
        assert_eq!(
            ports.transfer(&[], 2.0).unwrap(),
            2.0,
            "nothing: at arrival"
        );
        assert_eq!(ports.transfer(&[piece(3, 3, 1 << 30)], 2.0).unwrap(), 2.0);
    }

    #[test]
    fn striped_routing_uses_every_nic_of_the_node() {
        let t = Topology::h100(2, 8).unwrap();
        let b = 400_000_000;
        let direct = Ports::new(t.clone(), Routing::Direct)
            .unwrap()
            .transfer(&[piece(0, 8, b)], 0.0)
            .unwrap();
        let striped = Ports::new(t.clone(), Routing::Striped)
            .unwrap()
            .transfer(&[piece(0, 8, b)], 0.0)
            .unwrap();
        let offline = t
            .simulate(&[Transfer::new(0, 8, b, 0.0)], Routing::Striped)
            .unwrap()[0];
        assert!(close(striped, offline), "{striped} vs {offline}");
        assert!(striped < direct / 2.0, "striped {striped} direct {direct}");
    }

    #[test]
    fn hpz_crosses_the_nic_once_per_node_and_version() {
        let t = Topology::h100(2, 8).unwrap();
        let mut ports = Ports::new(t.clone(), Routing::Direct).unwrap();
        let key = |node, version| CopyKey {
            node,
            owner: 1,
            region: 7,
            start: 0,
            end: 100,
            version,
        };
        let b = 50_000_000;
        let first = ports
            .read(0, &[piece(8, 0, b)], Some(key(0, 1)), 0.0)
            .unwrap();
        let nic = t.nic.message_s(b);
        assert!(close(first, nic));
        // A neighbour arriving at once waits for the copy, then pulls it over NVLink.
        let second = ports
            .read(1, &[piece(8, 1, b)], Some(key(0, 1)), 0.0)
            .unwrap();
        assert!(second > first && second < first + nic / 4.0, "{second}");
        // A new version is a new copy: it crosses again (behind the first on the owner's port).
        let newer = ports
            .read(2, &[piece(8, 2, b)], Some(key(0, 2)), first)
            .unwrap();
        assert!(newer >= first + t.nic.serialize_s(b));
        // Without HPZ every reader crosses.
        let mut plain = Ports::new(t.clone(), Routing::Direct).unwrap();
        let a = plain.read(0, &[piece(8, 0, b)], None, 0.0).unwrap();
        let c = plain.read(1, &[piece(8, 1, b)], None, 0.0).unwrap();
        assert!(
            close(c - a, nic - t.nic.latency_s),
            "queued on the owner's egress"
        );
    }

    #[test]
    fn bad_devices_and_arrivals_are_errors_or_clamped_never_panics() {
        let t = Topology::h100(1, 4).unwrap();
        let mut ports = Ports::new(t, Routing::Striped).unwrap();
        assert!(matches!(
            ports.transfer(&[piece(0, 9, 1)], 0.0),
            Err(TopologyError::NoDevice { device: 9, .. })
        ));
        assert_eq!(ports.transfer(&[piece(0, 0, 1)], f64::NAN).unwrap(), 0.0);
        assert_eq!(ports.transfer(&[piece(0, 0, 1)], -1.0).unwrap(), 0.0);
    }
}
