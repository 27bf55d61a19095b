//! Hostile peers against a running 4-process `tcp` job of `examples/embed`: the job must finish
//! on every rank with the parameters of a run nobody attacked.
//!
//! - **Control plane**: peers with the wrong secret, each calling itself every rank of the job
//!   (ractor_cluster nodes named `odc-<job>-rank-<r>`, old and new style), connecting to every
//!   listening socket of every rank (the coordinator's door, ractor_cluster's own listeners, the
//!   data plane) again and again, plus odc handshakes with the wrong secret and garbage. Before
//!   odc's handshake guarded the control plane, one such peer made a rank conclude that the
//!   coordinator was gone.
//! - **1,000 idle connections to every listener** during the run: each listener keeps at most 64
//!   in its handshake (each for at most the handshake deadline) and closes the rest at once.
//!
//! Every listening socket of a rank is found from `/proc` (its socket inodes and the `LISTEN`
//! rows of its network namespace's TCP tables), so a listener added later is attacked too.

use std::collections::HashSet;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use odc_transport::wire::handshake::{self, HANDSHAKE_FRAME_CAP};
use odc_transport::wire::FrameReader;
use odc_transport::ClusterSecret;

use crate::harness::*;

const SECRET: &str = "the-real-job-secret-0123456789";
const WRONG: &str = "not-the-job-secret-0123456789";

/// Every TCP address process `pid` listens on, as an address to dial (a wildcard bind is dialed
/// on loopback).
fn listeners(pid: u32) -> Vec<SocketAddr> {
    let mut inodes = HashSet::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for entry in dir.flatten() {
            if let Ok(target) = std::fs::read_link(entry.path()) {
                let target = target.to_string_lossy().into_owned();
                if let Some(inode) = target
                    .strip_prefix("socket:[")
                    .and_then(|r| r.strip_suffix(']'))
                {
                    inodes.insert(inode.to_string());
                }
            }
        }
    }
    let mut found = Vec::new();
    for (table, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st ... inode (field 9); st 0A = LISTEN.
            if fields.len() < 10 || fields[3] != "0A" || !inodes.contains(fields[9]) {
                continue;
            }
            if let Some(addr) = proc_address(fields[1], v6) {
                found.push(addr);
            }
        }
    }
    found
}

/// `/proc/net/tcp{,6}`'s `HEXIP:HEXPORT` (the address in host-order 32-bit words).
fn proc_address(field: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::new();
    for word in ip.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    let ip = if v6 {
        let octets: [u8; 16] = bytes.try_into().ok()?;
        IpAddr::V6(Ipv6Addr::from(octets))
    } else {
        let octets: [u8; 4] = bytes.try_into().ok()?;
        IpAddr::V4(Ipv4Addr::from(octets))
    };
    let ip = match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Some(SocketAddr::new(ip, port))
}

#[test]
fn proc_addresses_parse() {
    assert_eq!(
        proc_address("0100007F:1F90", false),
        Some("127.0.0.1:8080".parse().expect("addr"))
    );
    assert_eq!(
        proc_address("00000000:0050", false),
        Some("127.0.0.1:80".parse().expect("addr"))
    );
    assert_eq!(
        proc_address("00000000000000000000000001000000:0050", true),
        Some("[::1]:80".parse().expect("addr"))
    );
    assert_eq!(proc_address("zz:0050", false), None);
}

/// Every listener of every rank still running.
fn every_listener(ranks: &[u32]) -> Vec<SocketAddr> {
    ranks.iter().flat_map(|pid| listeners(*pid)).collect()
}

/// What the attacker did.
#[derive(Default)]
struct Tally {
    ractor_peers: AtomicU64,
    wrong_handshakes: AtomicU64,
    welcomed: AtomicU64,
    garbage: AtomicU64,
}

/// One round of attacks on `addr`: ractor_cluster peers with the wrong cookie naming themselves
/// each rank, an odc handshake with the wrong secret, garbage and an oversized length prefix.
async fn attack(
    addr: SocketAddr,
    peers: &[ractor::ActorRef<ractor_cluster::NodeServerMessage>],
    tally: &Tally,
) {
    for peer in peers {
        if ractor_cluster::client_connect(peer, addr).await.is_ok() {
            tally.ractor_peers.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Ok(Ok(stream)) =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await
    {
        let (read, mut write) = stream.into_split();
        let mut reader = FrameReader::new(read, HANDSHAKE_FRAME_CAP);
        let wrong = ClusterSecret::new(WRONG).expect("a long enough secret");
        let deadline = odc_transport::deadline_in(Duration::from_secs(2));
        tally.wrong_handshakes.fetch_add(1, Ordering::Relaxed);
        if handshake::dial(&mut reader, &mut write, &wrong, deadline)
            .await
            .is_ok()
        {
            tally.welcomed.fetch_add(1, Ordering::Relaxed);
        }
    }
    for bytes in [
        &b"\xff\xff\xff\xff\xff\xff\xff\xffhello"[..],
        &b"GET /metrics HTTP/1.1\r\n\r\n"[..],
        &[0u8; 64][..],
    ] {
        if let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = stream.write_all(bytes);
            tally.garbage.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The 4-rank `tcp` job every test here attacks (rank 3 hosts only a trainer, as in the failure
/// tests) and its reference: the same job in one process.
fn job_args(path: &std::path::Path) -> (Vec<String>, Vec<f32>, f64) {
    let (want, want_loss) = single(4, 4, &[]);
    let mut args = common_args();
    args.extend(
        [
            "--compute-delay-ms",
            "30",
            "--save-params",
            &path.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    (args, want, want_loss)
}

/// Every rank finished, and rank 0's parameters and loss are the reference's.
fn check(
    results: &[(Option<i32>, String, String)],
    path: &std::path::Path,
    want: &[f32],
    want_loss: f64,
    what: &str,
) {
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, (status, _, _))| *status != Some(0))
        .map(|(rank, (status, stdout, stderr))| {
            format!("rank {rank} ({status:?}):\n{stdout}\n{stderr}")
        })
        .collect();
    assert!(failed.is_empty(), "{what}: {}", failed.join("\n"));
    let finals = finals(&results[0].1);
    assert_eq!(finals.len(), 1, "{what}: {}", results[0].1);
    assert!(
        ((finals[0].0 - want_loss) / want_loss).abs() <= 1e-6,
        "{what}: {finals:?} vs {want_loss}"
    );
    assert_same_params(&params(path), want, what);
}

#[test]
fn hostile_control_plane_peers_change_nothing() {
    let path = temp("hostile.params");
    let (args, want, want_loss) = job_args(&path);
    let ranks = Ranks::start(4, "tcp", &[SECRET; 4], &args);
    let pids: Vec<u32> = (0..4).map(|r| ranks.pid(r)).collect();
    let job = ranks.job.clone();
    let job_done = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let attacker = {
        let (job_done, tally) = (job_done.clone(), tally.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().expect("a runtime");
            rt.block_on(async move {
                // Each rank's name in the job (as under torchrun, where the job name is the
                // default `odc` and nothing has to be guessed), old style and new.
                let mut peers = Vec::new();
                for rank in 0..4 {
                    for name in [
                        format!("odc-{job}-rank-{rank}"),
                        format!("odc-{job}-rank-{rank}-0123456789abcdef"),
                    ] {
                        let node = ractor_cluster::NodeServer::new(
                            0,
                            WRONG.to_string(),
                            name,
                            "attacker".into(),
                            None,
                            None,
                        );
                        if let Ok((server, _)) = ractor::Actor::spawn(None, node, ()).await {
                            peers.push(server);
                        }
                    }
                }
                assert!(!peers.is_empty(), "the attacker's nodes start");
                let mut rounds = 0u64;
                while !job_done.load(Ordering::Relaxed) {
                    for addr in every_listener(&pids) {
                        attack(addr, &peers, &tally).await;
                    }
                    rounds += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                for peer in peers {
                    peer.stop(None);
                }
                rounds
            })
        })
    };
    let results = ranks.wait(Duration::from_secs(180));
    job_done.store(true, Ordering::Relaxed);
    let rounds = attacker.join().expect("the attacker thread");
    let attempts = tally.ractor_peers.load(Ordering::Relaxed);
    eprintln!(
        "hostile control-plane peers: {rounds} rounds, {attempts} ractor_cluster connections, {} \
         wrong-secret handshakes, {} garbage connections",
        tally.wrong_handshakes.load(Ordering::Relaxed),
        tally.garbage.load(Ordering::Relaxed)
    );
    assert!(
        rounds >= 1 && attempts >= 8,
        "the attack ran: {rounds} rounds, {attempts} peers"
    );
    assert_eq!(
        tally.welcomed.load(Ordering::Relaxed),
        0,
        "no listener welcomes the wrong secret"
    );
    check(
        &results,
        &path,
        &want,
        want_loss,
        "under hostile control-plane peers",
    );
}

#[test]
fn a_thousand_idle_connections_to_every_listener_change_nothing() {
    let path = temp("idle.params");
    let (args, want, want_loss) = job_args(&path);
    let mut ranks = Ranks::start(4, "tcp", &[SECRET; 4], &args);
    let pids: Vec<u32> = (0..4).map(|r| ranks.pid(r)).collect();
    let stdout = ranks.take_stdout(0);
    let (lines, reader) = read_until(stdout, "step   1 ");
    let started = Instant::now();
    let mut idle = Vec::new();
    let listeners = every_listener(&pids);
    for addr in &listeners {
        // Up to 1,000 each; a listener whose backlog is full (connects time out) is left there.
        for _ in 0..1000 {
            match TcpStream::connect_timeout(addr, Duration::from_millis(500)) {
                Ok(stream) => idle.push(stream),
                Err(_) => break,
            }
        }
    }
    eprintln!(
        "{} idle connections to {} listeners opened in {:.2} s",
        idle.len(),
        listeners.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        listeners.len() >= 4,
        "every rank listens somewhere: {listeners:?}"
    );
    let mut results = ranks.wait(Duration::from_secs(180));
    drop(idle);
    results[0].1 = rest(reader, lines);
    check(
        &results,
        &path,
        &want,
        want_loss,
        "with 1,000 idle connections per listener",
    );
}
