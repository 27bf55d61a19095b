//! Topology and links: nodes × GPUs, NVLink inside a node, NICs across nodes, and what moving bytes
//! between devices costs.
//!
//! # Model
//!
//! - **Devices** `0..nodes·gpus_per_node`, a node's GPUs contiguous (device `d` is on node
//!   `d / gpus_per_node`), as ODC and NCCL number ranks.
//! - **Links**: every device has four FIFO queues — NVLink egress and ingress, NIC egress and
//!   ingress — each a [`Link`] of bandwidth (bytes/s, per direction) and latency. A transfer inside a
//!   node uses the source's NVLink egress and the destination's NVLink ingress; across nodes, the
//!   source's NIC egress and the destination's NIC ingress (one 400 Gb/s NIC per GPU, rail to rail).
//!   NVSwitch is non-blocking: only the endpoints' ports queue.
//! - **A transfer** ([`Transfer`]) of `b` bytes starts when it is ready (its `ready_s` and every
//!   transfer it comes `after` has finished) and both its ports are free; it holds both ports for
//!   `b / bandwidth` and finishes `latency` after that (store and forward of one message: large
//!   transfers are chunked by the runtime, which this does not model, so it is exact for the
//!   bandwidth term and pays one latency per message). Ports serve transfers in the order they
//!   become ready (ties by index): the simulation pops ready transfers from a binary heap, so it is
//!   event-driven and `O(n log n)` in the transfers. A transfer from a device to itself is free
//!   (a join point: it finishes when it is ready).
//! - **Routing** ([`Routing::Striped`], Zeppelin's routing layer): a cross-node transfer becomes
//!   `gpus_per_node` stripes: the source hands stripe `j` over NVLink to GPU `j` of its node (a
//!   proxy), the proxy sends it over its own NIC to GPU `j` of the destination node, which hands it
//!   over NVLink to the destination; all of a node's NICs carry one transfer. Each hop is store
//!   and forward of its whole stripe (no chunk pipelining across hops), so a striped transfer pays
//!   the source's NVLink fan-out before its last stripe crosses: an upper bound on Zeppelin's
//!   pipelined routing.
//! - **On-demand gather of a unit** ([`Topology::gather`]): every device owns `1/D` of the unit;
//!   a requester pulls every other owner's shard point to point. With **HPZ** (ODC's hierarchical
//!   partitioning) a node keeps a copy of the unit spread over its GPUs (GPU `j` holds the shards of
//!   the owners `o ≡ j mod gpus_per_node`): the first gather of the unit in a node brings every
//!   remote shard across the NIC once, to its holder; every gather in the node then pulls the unit
//!   from the node's holders over NVLink. A node already holding the unit (a later micro-batch of
//!   the same step) crosses no NIC at all. Size of the simulation: without HPZ a round of `D`
//!   requesters is `D·(D − 1)` transfers (a million at 1,024 devices); with HPZ about
//!   `nodes·D + D·G` (140K at 1,024 devices in nodes of 8; the unit test runs one in well under a
//!   second in a debug build).
//! - **Collective ring** ([`Topology::ring_all_gather_s`], NCCL-like, no global barrier per
//!   round): `D − 1` steps of `bytes / D` over the slowest hop (the NIC when the ring spans nodes,
//!   NCCL running one ring per rail), plus the latency of the longest path a piece travels: `D − 1`
//!   hops, of which `nodes − 1` cross nodes (tens of µs each) and the rest stay inside (a few µs).
//!   Reduce-scatter costs the same on its own bytes.
//! - **Control messages** (dispatch, barrier): a message costs [`Topology::control_latency_s`];
//!   the supervisor handles messages one at a time at [`Topology::control_per_message_s`] each, so
//!   a barrier over `D` trainers costs `2·latency + D·per_message`.
//!
//! Defaults ([`Topology::h100`]): NVLink 450 GB/s per direction, 3 µs; NIC 400 Gb/s = 50 GB/s per
//! GPU, 10 µs; ring step 3 µs inside a node, 20 µs across; control message 20 µs, 1 µs handling.
//! The latencies are assumptions of the right order (NCCL's and RDMA's published ranges), not
//! measurements.
//!
//! # Guarantees
//!
//! [`Topology::simulate`] returns one finish time per transfer, each at least its ready time and
//! its dependencies' finish times; it is deterministic (ties broken by index) and refuses bad input
//! (a device out of range, a non-finite or negative ready time, a dependency that is not an earlier
//! transfer) with a [`TopologyError`] naming the transfer.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// What was wrong with a topology or a transfer set.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TopologyError {
    /// Zero nodes or zero GPUs per node.
    #[error(
        "a topology needs at least one node and one GPU per node (got {nodes} × {gpus_per_node})"
    )]
    Empty { nodes: u32, gpus_per_node: u32 },
    /// A link whose bandwidth is not finite and positive or whose latency is not finite and
    /// non-negative.
    #[error("link {name}: bandwidth {bytes_per_s} B/s, latency {latency_s} s: bandwidth must be finite and positive, latency finite and non-negative")]
    BadLink {
        name: &'static str,
        bytes_per_s: f64,
        latency_s: f64,
    },
    /// A device outside the topology.
    #[error("transfer {transfer}: device {device} is not in the topology of {devices} devices")]
    NoDevice {
        transfer: usize,
        device: u32,
        devices: u32,
    },
    /// A ready time that is not finite and non-negative.
    #[error("transfer {transfer}: ready time {ready_s} must be finite and non-negative")]
    BadReady { transfer: usize, ready_s: f64 },
    /// A dependency on the transfer itself or a later one.
    #[error("transfer {transfer}: depends on {after}, which is not an earlier transfer")]
    BadDependency { transfer: usize, after: usize },
    /// A gather of a unit over a device count the topology does not have.
    #[error("{what}: {devices} devices, the topology has {available}")]
    Devices {
        what: &'static str,
        devices: u32,
        available: u32,
    },
}

/// One direction of a link: bandwidth and per-message latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second in this direction.
    pub bytes_per_s: f64,
    /// Seconds from the last byte sent to the message delivered.
    pub latency_s: f64,
}

impl Link {
    /// Seconds `bytes` occupy the link.
    pub fn serialize_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes_per_s
    }

    /// Seconds of one message of `bytes` on an idle link.
    pub fn message_s(&self, bytes: u64) -> f64 {
        self.latency_s + self.serialize_s(bytes)
    }

    fn check(&self, name: &'static str) -> Result<(), TopologyError> {
        if self.bytes_per_s.is_finite()
            && self.bytes_per_s > 0.0
            && self.latency_s.is_finite()
            && self.latency_s >= 0.0
        {
            Ok(())
        } else {
            Err(TopologyError::BadLink {
                name,
                bytes_per_s: self.bytes_per_s,
                latency_s: self.latency_s,
            })
        }
    }
}

/// How cross-node transfers travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// Over the source's and destination's own NICs.
    #[default]
    Direct,
    /// Striped over all of the node's NICs through NVLink proxies (Zeppelin's routing layer).
    Striped,
}

/// A point-to-point transfer.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    pub src: u32,
    pub dst: u32,
    pub bytes: u64,
    /// Earliest start, seconds.
    pub ready_s: f64,
    /// Earlier transfers (indices) that must finish first.
    pub after: Vec<usize>,
}

impl Transfer {
    /// A transfer with no dependencies.
    pub fn new(src: u32, dst: u32, bytes: u64, ready_s: f64) -> Self {
        Transfer {
            src,
            dst,
            bytes,
            ready_s,
            after: Vec::new(),
        }
    }
}

/// Nodes × GPUs and their links (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// Per GPU, per direction, inside a node.
    pub nvlink: Link,
    /// Per GPU, per direction, across nodes.
    pub nic: Link,
    /// Latency of one ring hop inside a node.
    pub ring_step_intra_s: f64,
    /// Latency of one ring hop across nodes.
    pub ring_step_inter_s: f64,
    /// Latency of one control message (dispatch, report, barrier release).
    pub control_latency_s: f64,
    /// Supervisor time to handle one control message.
    pub control_per_message_s: f64,
}

impl Topology {
    /// H100 nodes with the defaults of the module docs.
    pub fn h100(nodes: u32, gpus_per_node: u32) -> Result<Self, TopologyError> {
        let t = Topology {
            nodes,
            gpus_per_node,
            nvlink: Link {
                bytes_per_s: 450e9,
                latency_s: 3e-6,
            },
            nic: Link {
                bytes_per_s: 50e9,
                latency_s: 10e-6,
            },
            ring_step_intra_s: 3e-6,
            ring_step_inter_s: 20e-6,
            control_latency_s: 20e-6,
            control_per_message_s: 1e-6,
        };
        t.validate()?;
        Ok(t)
    }

    /// `devices` H100s in nodes of eight (one partial node if `devices` is not a multiple).
    pub fn h100_devices(devices: u32) -> Result<Self, TopologyError> {
        let g = devices.clamp(1, 8);
        Self::h100(devices.div_ceil(g), g)
    }

    /// Checks the shape and every link and latency.
    pub fn validate(&self) -> Result<(), TopologyError> {
        if self.nodes == 0 || self.gpus_per_node == 0 {
            return Err(TopologyError::Empty {
                nodes: self.nodes,
                gpus_per_node: self.gpus_per_node,
            });
        }
        self.nvlink.check("nvlink")?;
        self.nic.check("nic")?;
        for (name, latency_s) in [
            ("ring step inside a node", self.ring_step_intra_s),
            ("ring step across nodes", self.ring_step_inter_s),
            ("control message", self.control_latency_s),
            ("control handling", self.control_per_message_s),
        ] {
            Link {
                bytes_per_s: 1.0,
                latency_s,
            }
            .check(name)?;
        }
        Ok(())
    }

    /// Number of devices.
    pub fn devices(&self) -> u32 {
        self.nodes * self.gpus_per_node
    }

    /// Node of device `d`.
    pub fn node_of(&self, d: u32) -> u32 {
        d / self.gpus_per_node
    }

    /// The link a transfer between `src` and `dst` uses.
    pub fn link(&self, src: u32, dst: u32) -> Link {
        if self.node_of(src) == self.node_of(dst) {
            self.nvlink
        } else {
            self.nic
        }
    }

    /// Finish time of every transfer (see the module docs), routed by `routing`.
    pub fn simulate(
        &self,
        transfers: &[Transfer],
        routing: Routing,
    ) -> Result<Vec<f64>, TopologyError> {
        self.validate()?;
        let n = self.devices();
        for (i, t) in transfers.iter().enumerate() {
            for device in [t.src, t.dst] {
                if device >= n {
                    return Err(TopologyError::NoDevice {
                        transfer: i,
                        device,
                        devices: n,
                    });
                }
            }
            if !t.ready_s.is_finite() || t.ready_s < 0.0 {
                return Err(TopologyError::BadReady {
                    transfer: i,
                    ready_s: t.ready_s,
                });
            }
            if let Some(&after) = t.after.iter().find(|&&a| a >= i) {
                return Err(TopologyError::BadDependency { transfer: i, after });
            }
        }
        match routing {
            Routing::Direct => Ok(self.run(transfers)),
            Routing::Striped => {
                let (hops, ends) = self.stripe(transfers);
                let finish = self.run(&hops);
                Ok(ends.iter().map(|&e| finish[e]).collect())
            }
        }
    }

    /// Zeppelin's routing: every cross-node transfer as stripes through proxies, joined by a free
    /// transfer; returns the hops and, per original transfer, the hop whose finish is its finish.
    fn stripe(&self, transfers: &[Transfer]) -> (Vec<Transfer>, Vec<usize>) {
        let g = self.gpus_per_node;
        let mut hops: Vec<Transfer> = Vec::with_capacity(transfers.len());
        let mut ends: Vec<usize> = Vec::with_capacity(transfers.len());
        for t in transfers {
            let after: Vec<usize> = t.after.iter().map(|&a| ends[a]).collect();
            let (a, b) = (self.node_of(t.src), self.node_of(t.dst));
            if a == b {
                hops.push(Transfer { after, ..t.clone() });
                ends.push(hops.len() - 1);
                continue;
            }
            let mut lasts = Vec::with_capacity(g as usize);
            for j in 0..g {
                let bytes = t.bytes / u64::from(g) + u64::from(j < (t.bytes % u64::from(g)) as u32);
                let (pa, pb) = (a * g + j, b * g + j);
                let mut prev = after.clone();
                for (src, dst) in [(t.src, pa), (pa, pb), (pb, t.dst)] {
                    if src != dst {
                        hops.push(Transfer {
                            src,
                            dst,
                            bytes,
                            ready_s: t.ready_s,
                            after: prev,
                        });
                        prev = vec![hops.len() - 1];
                    }
                }
                lasts.extend(prev);
            }
            hops.push(Transfer {
                src: t.dst,
                dst: t.dst,
                bytes: 0,
                ready_s: t.ready_s,
                after: lasts,
            });
            ends.push(hops.len() - 1);
        }
        (hops, ends)
    }

    /// The event-driven FIFO simulation of checked, direct transfers.
    fn run(&self, transfers: &[Transfer]) -> Vec<f64> {
        let n = self.devices() as usize;
        // Port free times: [nvlink egress, nvlink ingress, nic egress, nic ingress] per device.
        let mut free = vec![[0.0f64; 4]; n];
        let mut ready: Vec<f64> = transfers.iter().map(|t| t.ready_s).collect();
        let mut pending: Vec<usize> = transfers.iter().map(|t| t.after.len()).collect();
        // Dependents in CSR form.
        let mut starts = vec![0usize; transfers.len() + 1];
        for t in transfers {
            for &a in &t.after {
                starts[a + 1] += 1;
            }
        }
        for i in 0..transfers.len() {
            starts[i + 1] += starts[i];
        }
        let mut fill = starts.clone();
        let mut dependents = vec![0usize; starts[transfers.len()]];
        for (i, t) in transfers.iter().enumerate() {
            for &a in &t.after {
                dependents[fill[a]] = i;
                fill[a] += 1;
            }
        }
        let mut heap: BinaryHeap<Reverse<(Time, usize)>> = transfers
            .iter()
            .enumerate()
            .filter(|(_, t)| t.after.is_empty())
            .map(|(i, t)| Reverse((Time(t.ready_s), i)))
            .collect();
        let mut finish = vec![0.0f64; transfers.len()];
        while let Some(Reverse((Time(at), i))) = heap.pop() {
            let t = &transfers[i];
            let done = self.hop(&mut free, t.src, t.dst, t.bytes, at);
            finish[i] = done;
            for &j in &dependents[starts[i]..starts[i + 1]] {
                ready[j] = ready[j].max(done);
                pending[j] -= 1;
                if pending[j] == 0 {
                    heap.push(Reverse((Time(ready[j]), j)));
                }
            }
        }
        finish
    }

    /// One direct hop of `bytes` from `src` to `dst` ready at `at`, on the port free times `free`
    /// (per device: NVLink egress, NVLink ingress, NIC egress, NIC ingress; devices checked by
    /// the caller): it starts when both ports are free, holds them for the serialisation and
    /// finishes a latency later; returns the finish. A hop from a device to itself is free.
    pub(crate) fn hop(
        &self,
        free: &mut [[f64; 4]],
        src: u32,
        dst: u32,
        bytes: u64,
        at: f64,
    ) -> f64 {
        if src == dst {
            return at;
        }
        let (s, d) = (src as usize, dst as usize);
        let (out, inp, link) = if self.node_of(src) == self.node_of(dst) {
            (0, 1, self.nvlink)
        } else {
            (2, 3, self.nic)
        };
        let start = at.max(free[s][out]).max(free[d][inp]);
        let end = start + link.serialize_s(bytes);
        free[s][out] = end;
        free[d][inp] = end;
        end + link.latency_s
    }

    /// Finish time of each on-demand gather of one unit of `unit_bytes`, sharded evenly over all
    /// devices; `requests` are `(device, ready_s)`. With `hpz`, `holding[node]` says the node
    /// already holds its copy of the unit (missing entries: it does not). See the module docs.
    pub fn gather(
        &self,
        unit_bytes: u64,
        requests: &[(u32, f64)],
        hpz: bool,
        holding: &[bool],
        routing: Routing,
    ) -> Result<Vec<f64>, TopologyError> {
        self.validate()?;
        let d = self.devices();
        if let Some(i) = requests.iter().position(|r| r.0 >= d) {
            return Err(TopologyError::NoDevice {
                transfer: i,
                device: requests[i].0,
                devices: d,
            });
        }
        let shard = unit_bytes / u64::from(d);
        let mut transfers: Vec<Transfer> = Vec::new();
        let mut ends: Vec<usize> = Vec::with_capacity(requests.len());
        let join = |transfers: &mut Vec<Transfer>, at: u32, ready_s: f64, after: Vec<usize>| {
            transfers.push(Transfer {
                src: at,
                dst: at,
                bytes: 0,
                ready_s,
                after,
            });
            transfers.len() - 1
        };
        if !hpz {
            for &(r, ready_s) in requests {
                let first = transfers.len();
                for o in (0..d).filter(|&o| o != r) {
                    transfers.push(Transfer::new(o, r, shard, ready_s));
                }
                let all = (first..transfers.len()).collect();
                ends.push(join(&mut transfers, r, ready_s, all));
            }
            let finish = self.simulate(&transfers, routing)?;
            return Ok(ends.iter().map(|&e| finish[e]).collect());
        }
        let g = self.gpus_per_node;
        // Per node: when its first request is ready, and the join of each holder's part.
        let mut first_ready: Vec<Option<f64>> = vec![None; self.nodes as usize];
        for &(r, ready_s) in requests {
            let slot = &mut first_ready[self.node_of(r) as usize];
            *slot = Some(slot.map_or(ready_s, |s: f64| s.min(ready_s)));
        }
        let mut holder_join: Vec<Option<usize>> = vec![None; d as usize];
        for (node, first) in first_ready.iter().enumerate() {
            let (Some(ready_s), false) = (*first, holding.get(node).copied().unwrap_or(false))
            else {
                continue;
            };
            let node = node as u32;
            for j in 0..g {
                let holder = node * g + j;
                let from = transfers.len();
                for o in (0..d).filter(|&o| o % g == j && self.node_of(o) != node) {
                    transfers.push(Transfer::new(o, holder, shard, ready_s));
                }
                let all = (from..transfers.len()).collect();
                holder_join[holder as usize] = Some(join(&mut transfers, holder, ready_s, all));
            }
        }
        for &(r, ready_s) in requests {
            let node = self.node_of(r);
            let mut parts = Vec::with_capacity(g as usize);
            for j in 0..g {
                let holder = node * g + j;
                // The holder's part: the shards of the D / G owners on its rail.
                let owners = (0..d).filter(|&o| o % g == j).count() as u64;
                let after = holder_join[holder as usize].into_iter().collect();
                transfers.push(Transfer {
                    src: holder,
                    dst: r,
                    bytes: shard * owners,
                    ready_s,
                    after,
                });
                parts.push(transfers.len() - 1);
            }
            ends.push(join(&mut transfers, r, ready_s, parts));
        }
        let finish = self.simulate(&transfers, routing)?;
        Ok(ends.iter().map(|&e| finish[e]).collect())
    }

    /// Seconds of an NCCL-like ring all-gather of `bytes` (the whole unit) over `devices` devices
    /// (the first `devices` of the topology; see the module docs). Zero for one device.
    pub fn ring_all_gather_s(&self, devices: u32, bytes: u64) -> Result<f64, TopologyError> {
        if devices == 0 || devices > self.devices() {
            return Err(TopologyError::Devices {
                what: "ring all-gather",
                devices,
                available: self.devices(),
            });
        }
        if devices == 1 {
            return Ok(0.0);
        }
        let nodes = devices.div_ceil(self.gpus_per_node);
        let bw = if nodes > 1 {
            self.nic.bytes_per_s.min(self.nvlink.bytes_per_s)
        } else {
            self.nvlink.bytes_per_s
        };
        let steps = f64::from(devices - 1);
        let inter = f64::from(nodes - 1);
        let latency = inter * self.ring_step_inter_s + (steps - inter) * self.ring_step_intra_s;
        Ok(steps * (bytes as f64 / f64::from(devices)) / bw + latency)
    }

    /// Seconds of an NCCL-like ring reduce-scatter of `bytes` (the whole gradient): the same ring
    /// as [`Topology::ring_all_gather_s`].
    pub fn ring_reduce_scatter_s(&self, devices: u32, bytes: u64) -> Result<f64, TopologyError> {
        self.ring_all_gather_s(devices, bytes)
    }

    /// Seconds from the supervisor sending a dispatch to the trainer having it.
    pub fn dispatch_s(&self) -> f64 {
        self.control_latency_s + self.control_per_message_s
    }

    /// Seconds of the minibatch barrier over `trainers`: their reports in, the release out.
    pub fn barrier_s(&self, trainers: u32) -> f64 {
        2.0 * self.control_latency_s + f64::from(trainers) * self.control_per_message_s
    }
}

/// A totally ordered time for the event heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(x: f64, y: f64, rel: f64) -> bool {
        x.is_finite() && (x - y).abs() <= rel * y.abs().max(1e-15)
    }

    const MB: u64 = 1_000_000;

    #[test]
    fn one_transfer_costs_latency_plus_bytes_over_bandwidth() {
        let t = Topology::h100(2, 8).unwrap();
        let f = t
            .simulate(
                &[
                    Transfer::new(0, 1, 450 * MB, 0.5),
                    Transfer::new(0, 8, 50 * MB, 0.0),
                ],
                Routing::Direct,
            )
            .unwrap();
        assert_eq!(f.len(), 2);
        assert!(close(f[0], 0.5 + 1e-3 + 3e-6, 1e-12), "{f:?}");
        assert!(close(f[1], 1e-3 + 10e-6, 1e-12), "{f:?}");
    }

    #[test]
    fn a_port_serves_transfers_first_come_first_served() {
        let t = Topology::h100(2, 8).unwrap();
        // Three senders into device 8 across nodes: its NIC ingress serialises them.
        let xs: Vec<Transfer> = (0..3)
            .map(|s| Transfer::new(s, 8, 50 * MB, f64::from(s) * 1e-4))
            .collect();
        let f = t.simulate(&xs, Routing::Direct).unwrap();
        for (i, fi) in f.iter().enumerate() {
            let want = 1e-3 * (i + 1) as f64 + 10e-6;
            assert!(close(*fi, want, 1e-9), "{i}: {fi} vs {want}");
        }
        // The same senders into three different devices run in parallel.
        let ys: Vec<Transfer> = (0..3)
            .map(|s| Transfer::new(s, 8 + s, 50 * MB, 0.0))
            .collect();
        let g = t.simulate(&ys, Routing::Direct).unwrap();
        assert!(g.iter().all(|&x| close(x, 1e-3 + 10e-6, 1e-9)), "{g:?}");
        // Egress and ingress of NVLink and NIC are separate queues.
        let zs = [
            Transfer::new(0, 1, 450 * MB, 0.0),
            Transfer::new(0, 8, 50 * MB, 0.0),
        ];
        let h = t.simulate(&zs, Routing::Direct).unwrap();
        assert!(h[1] < 1.1e-3, "{h:?}");
    }

    #[test]
    fn dependencies_wait_and_self_transfers_are_free_joins() {
        let t = Topology::h100(1, 8).unwrap();
        let mut b = Transfer::new(1, 2, 450 * MB, 0.0);
        b.after = vec![0];
        let mut j = Transfer::new(2, 2, 0, 0.0);
        j.after = vec![0, 1];
        let f = t
            .simulate(&[Transfer::new(0, 1, 450 * MB, 0.0), b, j], Routing::Direct)
            .unwrap();
        assert!(close(f[1], 2.0 * (1e-3 + 3e-6), 1e-9), "{f:?}");
        assert_eq!(f[2], f[1]);
    }

    #[test]
    fn bad_transfers_are_refused_naming_the_transfer() {
        let t = Topology::h100(1, 8).unwrap();
        let err = t
            .simulate(
                &[Transfer::new(0, 1, 1, 0.0), Transfer::new(0, 9, 1, 0.0)],
                Routing::Direct,
            )
            .unwrap_err();
        assert_eq!(
            err,
            TopologyError::NoDevice {
                transfer: 1,
                device: 9,
                devices: 8
            }
        );
        let err = t
            .simulate(&[Transfer::new(0, 1, 1, f64::NAN)], Routing::Direct)
            .unwrap_err();
        assert!(matches!(err, TopologyError::BadReady { transfer: 0, .. }));
        let mut cyc = Transfer::new(0, 1, 1, 0.0);
        cyc.after = vec![0];
        let err = t.simulate(&[cyc], Routing::Direct).unwrap_err();
        assert_eq!(
            err,
            TopologyError::BadDependency {
                transfer: 0,
                after: 0
            }
        );
        assert!(matches!(
            Topology::h100(0, 8),
            Err(TopologyError::Empty { .. })
        ));
        let mut slow = Topology::h100(1, 8).unwrap();
        slow.nic.bytes_per_s = 0.0;
        assert!(matches!(
            slow.validate(),
            Err(TopologyError::BadLink { name: "nic", .. })
        ));
    }

    #[test]
    fn striped_routing_uses_every_nic_of_the_node() {
        let t = Topology::h100(2, 8).unwrap();
        let one = [Transfer::new(0, 8, 400 * MB, 0.0)];
        let direct = t.simulate(&one, Routing::Direct).unwrap()[0];
        let striped = t.simulate(&one, Routing::Striped).unwrap()[0];
        // 400 MB over one NIC: 8 ms. Striped over eight NICs: 1 ms each, after the source's
        // NVLink egress has handed out the seven other stripes (0.78 ms, store and forward), then
        // the last NVLink hop (0.11 ms): 1.9 ms.
        assert!(close(direct, 8e-3 + 10e-6, 1e-9), "{direct}");
        let want = 7.0 * 50e6 / 450e9 + 3e-6 + 1e-3 + 10e-6 + 50e6 / 450e9 + 3e-6;
        assert!(close(striped, want, 1e-9), "{striped} vs {want}");
        // Intra-node transfers are untouched, and dependencies map through the stripes.
        let mut dep = Transfer::new(8, 9, 450 * MB, 0.0);
        dep.after = vec![0];
        let f = t
            .simulate(&[one[0].clone(), dep], Routing::Striped)
            .unwrap();
        assert!(close(f[1], f[0] + 1e-3 + 3e-6, 1e-9), "{f:?}");
    }

    #[test]
    fn hpz_crosses_the_nic_once_per_node() {
        let t = Topology::h100(4, 8).unwrap();
        let unit = 466 * MB;
        let requests: Vec<(u32, f64)> = (0..32).map(|d| (d, 0.0)).collect();
        let plain = t
            .gather(unit, &requests, false, &[], Routing::Direct)
            .unwrap();
        let hpz = t
            .gather(unit, &requests, true, &[], Routing::Direct)
            .unwrap();
        assert_eq!((plain.len(), hpz.len()), (32, 32));
        let worst = |v: &[f64]| v.iter().copied().fold(0.0f64, f64::max);
        // Without HPZ each device pulls 3/4 of the unit over its NIC: ≥ 7 ms.
        assert!(
            worst(&plain) > 0.75 * unit as f64 / 50e9,
            "{}",
            worst(&plain)
        );
        // With HPZ each holder receives 3/4 of its 1/8 over its NIC, then NVLink.
        assert!(
            worst(&hpz) < 0.5 * worst(&plain),
            "{} vs {}",
            worst(&hpz),
            worst(&plain)
        );
        // A node that already holds the unit: NVLink only, the unit over 450 GB/s (7/8 remote).
        let again = t
            .gather(unit, &[(3, 0.0)], true, &[true; 4], Routing::Direct)
            .unwrap();
        assert!(again[0] < 1.2e-3, "{again:?}");
        assert!(again[0] > 7.0 / 8.0 * unit as f64 / 450e9, "{again:?}");
    }

    #[test]
    fn the_ring_is_bound_by_the_nic_across_nodes() {
        let t = Topology::h100(128, 8).unwrap();
        let bytes = 466 * MB;
        assert_eq!(t.ring_all_gather_s(1, bytes).unwrap(), 0.0);
        let intra = t.ring_all_gather_s(8, bytes).unwrap();
        assert!(close(
            intra,
            7.0 / 8.0 * bytes as f64 / 450e9 + 7.0 * 3e-6,
            1e-12
        ));
        let wide = t.ring_all_gather_s(1024, bytes).unwrap();
        let want = 1023.0 / 1024.0 * bytes as f64 / 50e9 + 127.0 * 20e-6 + 896.0 * 3e-6;
        assert!(close(wide, want, 1e-12), "{wide} vs {want}");
        assert_eq!(
            t.ring_reduce_scatter_s(1024, bytes).unwrap(),
            t.ring_all_gather_s(1024, bytes).unwrap()
        );
        assert!(t.ring_all_gather_s(1025, bytes).is_err());
        assert!(close(t.barrier_s(1024), 40e-6 + 1024e-6, 1e-12));
    }

    #[test]
    fn a_thousand_devices_gather_in_event_time() {
        // 1,024 devices, HPZ: about 140K transfers per unit-wide gather round.
        let t = Topology::h100_devices(1024).unwrap();
        assert_eq!((t.nodes, t.gpus_per_node), (128, 8));
        let requests: Vec<(u32, f64)> = (0..1024).map(|d| (d, f64::from(d % 7) * 1e-4)).collect();
        let f = t
            .gather(466 * MB, &requests, true, &[], Routing::Direct)
            .unwrap();
        assert_eq!(f.len(), 1024);
        assert!(f
            .iter()
            .zip(&requests)
            .all(|(x, r)| x.is_finite() && *x > r.1));
    }
}
