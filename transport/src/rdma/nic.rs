//! What the `rdma` backend needs from a NIC, as traits: register a region's memory (an address and
//! an rkey peers can read it by), make a queue-pair endpoint, connect it to a peer's, and read
//! remote memory through the connection. Two implementations: the verbs one (`verbs.rs`, the only
//! code that calls `sideway`), and [`EmulatedNic`], an in-process stand-in with the same
//! behaviour where it matters to the layers above — reads by (address, rkey) of registered memory
//! only, a read of deregistered memory is a remote access error that breaks the connection, an
//! endpoint connects only to an endpoint it can reach — so that everything above the verbs calls
//! (connection exchange, handle resolution, the seqlock reads, error mapping, reconnection) runs,
//! and is tested by the conformance suite, on machines without a NIC.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::memory::{RegionMemory, RemoteMemory};

/// One side's queue-pair coordinates, exchanged over the control connection before reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpInfo {
    /// Port GID (RoCE, or InfiniBand across subnets); the emulated NIC puts its process here.
    pub(crate) gid: [u8; 16],
    /// Port LID (InfiniBand; 0 on RoCE).
    pub(crate) lid: u16,
    pub(crate) qpn: u32,
    /// First packet sequence number this side sends with.
    pub(crate) psn: u32,
    /// The port's active MTU (`ibv_mtu`: 1 = 256 bytes ... 5 = 4096 bytes).
    pub(crate) mtu: u8,
}

impl QpInfo {
    /// Encoded length.
    pub(crate) const BYTES: usize = 16 + 2 + 4 + 4 + 1;

    pub(crate) fn encode(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..16].copy_from_slice(&self.gid);
        out[16..18].copy_from_slice(&self.lid.to_le_bytes());
        out[18..22].copy_from_slice(&self.qpn.to_le_bytes());
        out[22..26].copy_from_slice(&self.psn.to_le_bytes());
        out[26] = self.mtu;
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() != Self::BYTES {
            return Err(format!(
                "queue-pair info of {} bytes, expected {}",
                bytes.len(),
                Self::BYTES
            ));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[..16]);
        let u32_at = |at: usize| {
            let mut word = [0u8; 4];
            word.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(word)
        };
        Ok(Self {
            gid,
            lid: u16::from_le_bytes([bytes[16], bytes[17]]),
            qpn: u32_at(18),
            psn: u32_at(22),
            mtu: bytes[26],
        })
    }
}

/// Why a read through a [`Channel`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ChannelError {
    /// The owner's NIC refused the access (the rkey or the range is not registered: the region
    /// was dropped). The connection is broken afterwards, as a real queue pair is.
    RemoteAccess(String),
    /// The reads did not complete by the deadline (the connection is not used again: its reads
    /// may still land).
    Deadline,
    /// The connection failed (the owner is gone, the link is down, a verbs call failed).
    Broken(String),
}

/// A NIC port.
pub(crate) trait Nic: Send + Sync + 'static {
    /// What it is, for logs and errors (`mlx5_0 port 1`, `emulated NIC of process 42`).
    fn describe(&self) -> String;
    /// The identity handles carry (`Descriptor::Rdma::gid`).
    fn gid(&self) -> String;
    /// Whether a handle issued on the NIC `gid` can be reached from this one (`Err` says why not).
    fn reach(&self, gid: &str) -> Result<(), String>;
    /// Register `memory` for remote reads; it stays registered (and alive) until the registration
    /// is dropped.
    fn register(&self, memory: Arc<RegionMemory>) -> Result<Box<dyn Registration>, String>;
    /// A new, unconnected endpoint (a reliable-connection queue pair).
    fn endpoint(&self) -> Result<Box<dyn Endpoint>, String>;
}

/// Memory registered for remote reads.
pub(crate) trait Registration: Send + Sync {
    /// The address peers read the memory's first byte at.
    fn addr(&self) -> u64;
    fn rkey(&self) -> u32;
}

/// An endpoint before it is connected.
pub(crate) trait Endpoint: Send {
    /// Its coordinates, for the peer.
    fn info(&self) -> QpInfo;
    /// Connect to the peer with coordinates `remote` (ready to send and to answer reads).
    fn connect(self: Box<Self>, remote: &QpInfo) -> Result<Box<dyn Channel>, String>;
}

/// A connected endpoint.
pub(crate) trait Channel: Send {
    /// Read each `into.len()` bytes at the peer's `addr` (registered under `rkey`) into `into`; all
    /// complete when this returns `Ok`.
    fn read_many(
        &mut self,
        rkey: u32,
        reads: &mut [(u64, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), ChannelError>;
}

/// One region's memory through a channel, for the seqlock protocol.
pub(crate) struct Reach<'a> {
    pub(crate) channel: &'a mut dyn Channel,
    pub(crate) rkey: u32,
    pub(crate) deadline: Instant,
}

impl RemoteMemory for Reach<'_> {
    type Error = ChannelError;
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), ChannelError> {
        self.channel.read_many(self.rkey, reads, self.deadline)
    }
}

// ---------------------------------------------------------------------------------------------
// The emulated NIC
// ---------------------------------------------------------------------------------------------

/// First 8 bytes of an emulated endpoint's GID; the next 4 are its process id.
const EMULATED_GID: [u8; 8] = *b"EMULATED";
const EMULATED_PREFIX: &str = "emulated:";

/// Memory registered with the emulated NICs of this process, by rkey.
static REGISTERED: Mutex<BTreeMap<u32, Arc<RegionMemory>>> = Mutex::new(BTreeMap::new());
static NEXT_RKEY: AtomicU32 = AtomicU32::new(1);
static NEXT_QPN: AtomicU32 = AtomicU32::new(1);

fn registered() -> MutexGuard<'static, BTreeMap<u32, Arc<RegionMemory>>> {
    // A panic while holding the lock leaves the map consistent (inserts and removes only).
    REGISTERED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An in-process NIC: memory registered with it can be read by the emulated NICs of the same
/// process, through the same connection exchange and seqlock protocol as over verbs. For tests
/// and for running the backend where there is no NIC; it does not cross processes.
#[derive(Debug, Default)]
pub(crate) struct EmulatedNic;

impl EmulatedNic {
    fn gid_bytes() -> [u8; 16] {
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&EMULATED_GID);
        gid[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        gid
    }
}

impl Nic for EmulatedNic {
    fn describe(&self) -> String {
        format!("emulated NIC of process {}", std::process::id())
    }

    fn gid(&self) -> String {
        format!("{EMULATED_PREFIX}{}", std::process::id())
    }

    fn reach(&self, gid: &str) -> Result<(), String> {
        if gid == self.gid() {
            Ok(())
        } else {
            Err(format!(
                "it was registered on NIC {gid:?}; the emulated NIC of process {} reaches only \
                 regions of its own process",
                std::process::id()
            ))
        }
    }

    fn register(&self, memory: Arc<RegionMemory>) -> Result<Box<dyn Registration>, String> {
        let rkey = NEXT_RKEY.fetch_add(1, Ordering::Relaxed);
        let addr = memory.base() as u64;
        registered().insert(rkey, memory);
        Ok(Box::new(EmulatedRegistration { rkey, addr }))
    }

    fn endpoint(&self) -> Result<Box<dyn Endpoint>, String> {
        Ok(Box::new(EmulatedEndpoint {
            qpn: NEXT_QPN.fetch_add(1, Ordering::Relaxed),
        }))
    }
}

struct EmulatedRegistration {
    rkey: u32,
    addr: u64,
}

impl Registration for EmulatedRegistration {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for EmulatedRegistration {
    fn drop(&mut self) {
        registered().remove(&self.rkey);
    }
}

struct EmulatedEndpoint {
    qpn: u32,
}

impl Endpoint for EmulatedEndpoint {
    fn info(&self) -> QpInfo {
        QpInfo {
            gid: EmulatedNic::gid_bytes(),
            lid: 0,
            qpn: self.qpn,
            psn: 0,
            mtu: 5,
        }
    }

    fn connect(self: Box<Self>, remote: &QpInfo) -> Result<Box<dyn Channel>, String> {
        if remote.gid != EmulatedNic::gid_bytes() {
            return Err(format!(
                "the peer's endpoint (GID {:02x?}) is not an emulated NIC of this process {}",
                remote.gid,
                std::process::id()
            ));
        }
        Ok(Box::new(EmulatedChannel { broken: None }))
    }
}

struct EmulatedChannel {
    /// Why the connection broke (a queue pair in the error state stays there).
    broken: Option<String>,
}

impl Channel for EmulatedChannel {
    fn read_many(
        &mut self,
        rkey: u32,
        reads: &mut [(u64, &mut [u8])],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        if let Some(why) = &self.broken {
            return Err(ChannelError::Broken(why.clone()));
        }
        if Instant::now() >= deadline {
            return Err(ChannelError::Deadline);
        }
        let memory = registered().get(&rkey).cloned();
        let mut refuse = |what: String| {
            let what = format!("remote access error: {what}");
            self.broken = Some(what.clone());
            ChannelError::RemoteAccess(what)
        };
        let Some(memory) = memory else {
            return Err(refuse(format!("rkey {rkey:#x} is not registered")));
        };
        let base = memory.base() as u64;
        for (addr, into) in reads.iter_mut() {
            let read = addr
                .checked_sub(base)
                .and_then(|offset| usize::try_from(offset).ok())
                .ok_or_else(|| format!("address {addr:#x} is below rkey {rkey:#x}'s memory"))
                .and_then(|offset| memory.read_at(offset, into));
            if let Err(what) = read {
                return Err(refuse(what));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::memory::{Identity, Layout};
    use super::*;

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(10)
    }

    #[test]
    fn qp_info_round_trips_and_refuses_other_lengths() {
        let info = QpInfo {
            gid: [7; 16],
            lid: 0xbeef,
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            mtu: 3,
        };
        assert_eq!(QpInfo::decode(&info.encode()), Ok(info));
        assert!(QpInfo::decode(&info.encode()[1..]).is_err());
        assert!(QpInfo::decode(&[0; QpInfo::BYTES + 1]).is_err());
    }

    #[test]
    fn emulated_reads_need_a_registration_and_break_on_a_bad_access() {
        let nic = EmulatedNic;
        assert_eq!(nic.reach(&nic.gid()), Ok(()));
        assert!(nic.reach("emulated:1").is_err() || std::process::id() == 1);
        assert!(nic
            .reach("fe80:0000:0000:0000:0000:0000:0000:0001")
            .is_err());

        let layout = Layout::new(1, 16, 8).expect("layout");
        let who = Identity {
            owner: 1,
            instance: 1,
            region: 2,
        };
        let memory = Arc::new(RegionMemory::new(layout, who, &[9; 16], 1).expect("memory"));
        let registration = nic.register(Arc::clone(&memory)).expect("register");
        let owner = nic.endpoint().expect("owner endpoint");
        let reader = nic.endpoint().expect("reader endpoint");
        let (owner_info, reader_info) = (owner.info(), reader.info());
        let _owner = owner.connect(&reader_info).expect("owner connects");
        let mut channel = reader.connect(&owner_info).expect("reader connects");

        let data = registration.addr() + layout.data_offset as u64;
        let mut out = [0u8; 16];
        channel
            .read_many(registration.rkey(), &mut [(data, &mut out[..])], far())
            .expect("read");
        assert_eq!(out, [9; 16]);
        assert_eq!(
            channel.read_many(
                registration.rkey(),
                &mut [(data, &mut out[..])],
                Instant::now()
            ),
            Err(ChannelError::Deadline)
        );
        // Past the registration: refused, and the channel is broken from then on.
        let past = registration.addr() + layout.total as u64;
        assert!(matches!(
            channel.read_many(registration.rkey(), &mut [(past, &mut out[..])], far()),
            Err(ChannelError::RemoteAccess(_))
        ));
        assert!(matches!(
            channel.read_many(registration.rkey(), &mut [(data, &mut out[..])], far()),
            Err(ChannelError::Broken(_))
        ));
        // A dropped registration is a remote access error.
        let rkey = registration.rkey();
        drop(registration);
        let mut fresh = nic
            .endpoint()
            .expect("endpoint")
            .connect(&owner_info)
            .expect("connect");
        assert!(matches!(
            fresh.read_many(rkey, &mut [(data, &mut out[..])], far()),
            Err(ChannelError::RemoteAccess(_))
        ));
        // Only emulated endpoints of this process connect.
        let foreign = QpInfo {
            gid: [0xfe; 16],
            ..owner_info
        };
        assert!(nic.endpoint().expect("endpoint").connect(&foreign).is_err());
    }
}
