//! The verbs layer: the only code that calls `sideway` (ibverbs). It opens a device port, registers
//! region memory for remote reads, makes reliable-connection queue pairs, connects them with the
//! peer's coordinates (exchanged by the layer above over the control connection) and posts RDMA
//! READs with the `ibv_wr_*` API, polling their completions until a deadline. Everything that
//! decides what to read and whether it is consistent is above ([`super::memory`] and `crate::seqlock`, `mod.rs`).
//!
//! No device is a clear [`TransportError::Unsupported`] whose message starts with `no RDMA device`
//! and names the case: no rdma-core (`libibverbs` is loaded at run time; without it every call is
//! `EOPNOTSUPP`), no kernel RDMA stack (`ibv_get_device_list` fails with `ENOSYS`), or no NIC (the
//! list is empty).

use std::net::Ipv6Addr;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    ExtendedCompletionQueue, GenericCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SendOperationFlags, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::memory::RegionMemory;
use super::nic::{Channel, ChannelError, Endpoint, Nic, QpInfo, Registration};
use crate::TransportError;

/// Work requests in flight per queue pair (and completion-queue depth).
const MAX_WR: usize = 64;
/// Largest single RDMA READ (larger reads go in parts).
const MAX_READ: usize = 1 << 30;
/// Smallest reader staging buffer.
const MIN_STAGING: usize = 64 << 10;
/// Read/atomic operations in flight per queue pair, at most (the device may allow fewer).
const RD_ATOMIC: u8 = 16;
/// Failed polls before the poller yields the thread.
const SPINS_BEFORE_YIELD: u32 = 64;

fn no_device(what: impl std::fmt::Display) -> TransportError {
    TransportError::Unsupported {
        what: format!("no RDMA device: {what}"),
    }
}

fn unsupported(what: String) -> TransportError {
    TransportError::Unsupported { what }
}

/// An error and its sources, on one line (sideway's errors keep the errno in a source).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// Which port to open.
#[derive(Debug, Clone)]
pub(crate) struct PortChoice {
    /// Device name (`mlx5_0`); the first device if `None`.
    pub(crate) device: Option<String>,
    /// Port number (from 1).
    pub(crate) port: u8,
    /// GID index on the port (RoCE v2 is usually 1 or 3; InfiniBand 0).
    pub(crate) gid_index: u32,
}

/// One opened device port and what every endpoint on it shares.
struct Port {
    name: String,
    port: u8,
    gid_index: u8,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    /// Reads this side answers at once (responder resources).
    dest_rd_atomic: u8,
    /// Reads this side has in flight at once (initiator depth).
    rd_atomic: u8,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
}

/// A device port opened through verbs.
pub(crate) struct VerbsNic {
    port: Arc<Port>,
}

/// Open the port `choice` names, or say clearly why there is no RDMA device to open.
pub(crate) fn open(choice: &PortChoice) -> Result<VerbsNic, TransportError> {
    let list = DeviceList::new().map_err(|e| {
        let errno = match &e.0 {
            GetDeviceListErrorKind::Ibverbs(io) => io.raw_os_error(),
            #[allow(unreachable_patterns)]
            _ => None,
        };
        match errno {
            Some(libc::EOPNOTSUPP) => no_device(
                "libibverbs (rdma-core) is not installed, so no RDMA device can be listed \
                 (ibv_get_device_list: EOPNOTSUPP); install rdma-core (libibverbs1 and the NIC's \
                 provider) or use the tcp backend",
            ),
            Some(libc::ENOSYS) => no_device(
                "the kernel has no RDMA support (ibv_get_device_list: ENOSYS, function not \
                 implemented); load ib_uverbs and the NIC's driver, or use the tcp backend",
            ),
            _ => no_device(format!("ibv_get_device_list failed: {}", chain(&e))),
        }
    })?;
    if list.is_empty() {
        return Err(no_device(
            "the RDMA stack is loaded but lists no device (ibv_get_device_list returned an empty \
             list): this host has no RDMA NIC, or its driver is not loaded; use the tcp backend",
        ));
    }
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    let device = match &choice.device {
        Some(wanted) => list.iter().find(|d| d.name() == *wanted).ok_or_else(|| {
            no_device(format!(
                "no device named {wanted:?} (found: {})",
                names.join(", ")
            ))
        })?,
        None => list
            .get(0)
            .ok_or_else(|| no_device("the device list has no first device"))?,
    };
    let name = device.name();
    let ctx = device
        .open()
        .map_err(|e| unsupported(format!("rdma: cannot open device {name}: {}", chain(&e))))?;
    let attr = ctx
        .query_device()
        .map_err(|e| unsupported(format!("rdma: cannot query device {name}: {}", chain(&e))))?;
    let port_attr = ctx.query_port(choice.port).map_err(|e| {
        unsupported(format!(
            "rdma: cannot query port {} of {name}: {}",
            choice.port,
            chain(&e)
        ))
    })?;
    if port_attr.port_state() != PortState::Active {
        return Err(unsupported(format!(
            "rdma: port {} of {name} is not active ({:?})",
            choice.port,
            port_attr.port_state()
        )));
    }
    let gid_index = u8::try_from(choice.gid_index)
        .map_err(|_| unsupported(format!("rdma: GID index {} is above 255", choice.gid_index)))?;
    let gid = ctx.query_gid(choice.port, choice.gid_index).map_err(|e| {
        unsupported(format!(
            "rdma: cannot query GID {} of port {} of {name}: {}",
            choice.gid_index,
            choice.port,
            chain(&e)
        ))
    })?;
    let pd = ctx.alloc_pd().map_err(|e| {
        unsupported(format!(
            "rdma: cannot allocate a protection domain on {name}: {}",
            chain(&e)
        ))
    })?;
    let clamp = |n: i32| u8::try_from(n.clamp(1, i32::from(RD_ATOMIC))).unwrap_or(1);
    Ok(VerbsNic {
        port: Arc::new(Port {
            name,
            port: choice.port,
            gid_index,
            gid,
            lid: port_attr.lid(),
            mtu: port_attr.active_mtu(),
            dest_rd_atomic: clamp(attr.max_qp_rd_atom()),
            rd_atomic: clamp(attr.max_qp_init_rd_atom()),
            pd,
            ctx,
        }),
    })
}

impl Nic for VerbsNic {
    fn describe(&self) -> String {
        format!(
            "{} port {} (GID {})",
            self.port.name, self.port.port, self.port.gid
        )
    }

    fn gid(&self) -> String {
        Ipv6Addr::from(self.port.gid.raw).to_string()
    }

    fn reach(&self, gid: &str) -> Result<(), String> {
        match gid.parse::<Ipv6Addr>() {
            Ok(_) => Ok(()),
            Err(_) => Err(format!(
                "it was registered on {gid:?}, not a NIC GID (an emulated NIC?); {} reaches only \
                 real NICs",
                self.describe()
            )),
        }
    }

    fn register(&self, memory: Arc<RegionMemory>) -> Result<Box<dyn Registration>, String> {
        let len = memory.layout().total;
        // SAFETY: `memory.base()` is valid for `len` bytes (the whole allocation) for as long as
        // `memory` lives, and the registration below owns `memory` and drops the memory region
        // (deregisters) before it (field order), so the NIC never reads freed memory. The NIC only
        // reads it (`RemoteRead`); the owner keeps writing it with atomics, which is what the
        // seqlock expects.
        let mr = unsafe {
            self.port
                .pd
                .reg_mr(memory.base() as usize, len, AccessFlags::RemoteRead)
        }
        .map_err(|e| {
            format!(
                "cannot register {len} bytes on {}: {}",
                self.describe(),
                chain(&e)
            )
        })?;
        Ok(Box::new(VerbsRegistration {
            mr,
            _memory: memory,
        }))
    }

    fn endpoint(&self) -> Result<Box<dyn Endpoint>, String> {
        let port = &self.port;
        let fail = |what: &str, e: &dyn std::error::Error| {
            format!("cannot {what} on {}: {}", self.describe(), chain(e))
        };
        let depth = u32::try_from(MAX_WR).unwrap_or(64);
        let cq = port
            .ctx
            .create_cq_builder()
            .setup_cqe(depth)
            .build_ex()
            .map_err(|e| fail("create a completion queue", &e))?;
        let mut qp = port
            .pd
            .create_qp_builder()
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_ops_flags(SendOperationFlags::Read)
            .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
            .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
            .build_ex()
            .map_err(|e| fail("create a queue pair", &e))?;
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
        qp.modify(&init)
            .map_err(|e| fail("move a queue pair to INIT", &e))?;
        Ok(Box::new(VerbsEndpoint {
            qp,
            cq,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            port: Arc::clone(port),
        }))
    }
}

struct VerbsRegistration {
    // Dropped first: deregistered before the memory can be freed.
    mr: Arc<MemoryRegion>,
    _memory: Arc<RegionMemory>,
}

impl Registration for VerbsRegistration {
    fn addr(&self) -> u64 {
        self.mr.get_ptr() as u64
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

struct VerbsEndpoint {
    // Destroyed before its completion queue (which it also holds a reference to).
    qp: ExtendedQueuePair,
    cq: Arc<ExtendedCompletionQueue>,
    psn: u32,
    port: Arc<Port>,
}

fn mtu_of(code: u8) -> Option<Mtu> {
    [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ]
    .into_iter()
    .find(|mtu| *mtu as u32 == u32::from(code))
}

impl Endpoint for VerbsEndpoint {
    fn info(&self) -> QpInfo {
        QpInfo {
            gid: self.port.gid.raw,
            lid: self.port.lid,
            qpn: self.qp.qp_number(),
            psn: self.psn,
            mtu: u8::try_from(self.port.mtu as u32).unwrap_or(1),
        }
    }

    fn connect(mut self: Box<Self>, remote: &QpInfo) -> Result<Box<dyn Channel>, String> {
        let port = Arc::clone(&self.port);
        let theirs = mtu_of(remote.mtu)
            .ok_or_else(|| format!("the peer's MTU code {} is not valid", remote.mtu))?;
        let fail = |what: &str, e: &dyn std::error::Error| {
            format!(
                "cannot move a queue pair to {what} on {} port {}: {}",
                port.name,
                port.port,
                chain(e)
            )
        };
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(theirs.min(port.mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(port.dest_rd_atomic)
            .setup_min_rnr_timer(12);
        let mut path = AddressHandleAttribute::new();
        path.setup_dest_lid(remote.lid)
            .setup_port(port.port)
            .setup_service_level(0);
        if remote.gid != [0u8; 16] {
            path.setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_src_gid_index(port.gid_index)
                .setup_grh_hop_limit(64);
        }
        rtr.setup_address_vector(&path);
        self.qp.modify(&rtr).map_err(|e| fail("RTR", &e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(port.rd_atomic);
        self.qp.modify(&rts).map_err(|e| fail("RTS", &e))?;
        let VerbsEndpoint { qp, cq, port, .. } = *self;
        Ok(Box::new(VerbsChannel {
            qp,
            cq,
            staging: None,
            broken: None,
            port,
        }))
    }
}

/// The reader's registered landing buffer for READs.
struct Staging {
    // Deregistered before the buffer is freed (field order).
    mr: Arc<MemoryRegion>,
    buf: Vec<u8>,
}

struct VerbsChannel {
    // Destroyed first: no READ can land in `staging` after the queue pair is gone.
    qp: ExtendedQueuePair,
    cq: Arc<ExtendedCompletionQueue>,
    staging: Option<Staging>,
    /// Why the queue pair cannot be used any more.
    broken: Option<String>,
    port: Arc<Port>,
}

impl VerbsChannel {
    fn staging(&mut self, bytes: usize) -> Result<&Staging, ChannelError> {
        let big_enough = self
            .staging
            .as_ref()
            .is_some_and(|staging| staging.buf.len() >= bytes);
        if !big_enough {
            // Deregister and free the old buffer first.
            self.staging = None;
            let len = bytes.max(MIN_STAGING).next_power_of_two();
            let mut buf = vec![0u8; len];
            // SAFETY: `buf` is valid for `len` bytes and is never reallocated; the `Staging`
            // holding both deregisters the memory region before it frees `buf` (field order), and
            // the queue pair that writes into it is destroyed before `staging` (field order of
            // `VerbsChannel`).
            let mr = unsafe {
                self.port
                    .pd
                    .reg_mr(buf.as_mut_ptr() as usize, len, AccessFlags::LocalWrite)
            }
            .map_err(|e| {
                ChannelError::Broken(format!(
                    "cannot register a {len}-byte read buffer on {}: {}",
                    self.port.name,
                    chain(&e)
                ))
            })?;
            self.staging = Some(Staging { mr, buf });
        }
        self.staging
            .as_ref()
            .ok_or_else(|| ChannelError::Broken("no read buffer".into()))
    }

    /// Wait for `n` completions; the first failed one decides the error.
    fn complete(&mut self, n: usize, deadline: Instant) -> Result<(), ChannelError> {
        let mut done = 0;
        let mut failed: Option<(u32, u32)> = None;
        let mut spins = 0u32;
        while done < n {
            match self.cq.start_poll() {
                Ok(poller) => {
                    for wc in poller {
                        done += 1;
                        if wc.status() != WorkCompletionStatus::Success as u32 && failed.is_none() {
                            failed = Some((wc.status(), wc.vendor_err()));
                        }
                    }
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                    if Instant::now() >= deadline {
                        self.broken =
                            Some("a read missed its deadline with reads in flight".into());
                        return Err(ChannelError::Deadline);
                    }
                    spins += 1;
                    if spins % SPINS_BEFORE_YIELD == 0 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                Err(e) => {
                    let why = format!("polling the completion queue failed: {}", chain(&e));
                    self.broken = Some(why.clone());
                    return Err(ChannelError::Broken(why));
                }
            }
        }
        // The READs' data is in the staging buffer once their completions are seen.
        fence(Ordering::Acquire);
        match failed {
            None => Ok(()),
            Some((status, vendor)) => {
                let access = status == WorkCompletionStatus::RemoteAccessError as u32
                    || status == WorkCompletionStatus::RemoteInvalidRequestError as u32;
                let why = format!(
                    "RDMA READ completed with status {status} ({}), vendor error {vendor:#x}",
                    if access {
                        "remote access error: the region is not registered there any more"
                    } else {
                        "the connection failed"
                    }
                );
                self.broken = Some(why.clone());
                Err(if access {
                    ChannelError::RemoteAccess(why)
                } else {
                    ChannelError::Broken(why)
                })
            }
        }
    }
}

impl Channel for VerbsChannel {
    fn read_many(
        &mut self,
        rkey: u32,
        reads: &mut [(u64, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        if let Some(why) = &self.broken {
            return Err(ChannelError::Broken(why.clone()));
        }
        // (remote address, offset in staging, length) of every READ, in parts of at most MAX_READ.
        let mut parts = Vec::new();
        let mut total = 0usize;
        for (addr, into) in reads.iter() {
            let mut done = 0;
            while done < into.len() {
                let len = (into.len() - done).min(MAX_READ);
                parts.push((addr.wrapping_add(done as u64), total + done, len));
                done += len;
            }
            total += into.len();
        }
        let staging = self.staging(total)?;
        let (lkey, base) = (staging.mr.lkey(), staging.buf.as_ptr() as u64);
        for batch in parts.chunks(MAX_WR) {
            let mut guard = self.qp.start_post_send();
            for (i, &(remote, local, len)) in batch.iter().enumerate() {
                let len = u32::try_from(len).unwrap_or(u32::MAX);
                let wr = guard
                    .construct_wr(i as u64, WorkRequestFlags::Signaled)
                    .setup_read(rkey, remote);
                // SAFETY: `[base + local, base + local + len)` lies inside the registered staging
                // buffer (`staging(total)` made it at least `total` bytes), which outlives the
                // work request (it is freed only after the queue pair is destroyed).
                unsafe { wr.setup_sge(lkey, base + local as u64, len) };
            }
            if let Err(e) = guard.post() {
                let why = format!("posting RDMA READs failed: {}", chain(&e));
                self.broken = Some(why.clone());
                return Err(ChannelError::Broken(why));
            }
            self.complete(batch.len(), deadline)?;
        }
        let staging = self
            .staging
            .as_ref()
            .ok_or_else(|| ChannelError::Broken("no read buffer".into()))?;
        let mut at = 0;
        for (_, into) in reads.iter_mut() {
            let len = into.len();
            into.copy_from_slice(&staging.buf[at..at + len]);
            at += len;
        }
        Ok(())
    }
}
