//! (b) Four processes, each in its own network namespace with its own address (veth pairs on a
//! bridge), over `tcp`, train to the single-process parameters. Skipped, with the reason
//! printed, only where namespaces cannot be made (not root, no `ip`, no veth/bridge support).

use std::process::Command;
use std::time::Duration;

use crate::harness::*;

/// Namespaces, veths and a bridge, removed on drop.
struct Net {
    tag: String,
    namespaces: u32,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("`ip` cannot run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Net {
    /// `namespaces` namespaces `odc<tag>n<r>` with 10.231.<x>.<r+1>/24 on bridge `odc<tag>b`,
    /// tagged `salt` besides the process id (tests of one process run side by side).
    fn make(namespaces: u32, salt: u32) -> Result<Net, String> {
        let tag = format!("{}", (std::process::id() % 10_000) * 10 + salt % 10);
        let net = Net { tag, namespaces };
        let bridge = net.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        for r in 0..namespaces {
            let ns = net.ns(r);
            let (host_end, ns_end) = (format!("odc{}h{r}", net.tag), format!("odc{}v{r}", net.tag));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &host_end, "type", "veth", "peer", "name", &ns_end,
            ])?;
            ip(&["link", "set", &ns_end, "netns", &ns])?;
            ip(&["link", "set", &host_end, "master", &bridge])?;
            ip(&["link", "set", &host_end, "up"])?;
            let addr = format!("{}/24", net.addr(r));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &ns_end])?;
            ip(&["-n", &ns, "link", "set", &ns_end, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("odc{}b", self.tag)
    }

    fn ns(&self, rank: u32) -> String {
        format!("odc{}n{rank}", self.tag)
    }

    fn addr(&self, rank: u32) -> String {
        format!(
            "10.231.{}.{}",
            (self.tag.parse::<u32>().unwrap_or(0) % 250) + 1,
            rank + 1
        )
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for r in 0..self.namespaces {
            let _ = ip(&["link", "del", &format!("odc{}h{r}", self.tag)]);
            let _ = ip(&["netns", "del", &self.ns(r)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

/// Each rank sees `LOCAL_WORLD_SIZE=1`: one process a host pushes straight by default.
#[test]
fn four_processes_in_their_own_network_namespaces_train_to_the_single_process_parameters() {
    let world = 4;
    let net = match Net::make(world, 0) {
        Ok(net) => net,
        Err(reason) => {
            eprintln!("SKIPPED: network namespaces cannot be made here: {reason}");
            return;
        }
    };
    let (want, want_loss) = single(4, 4, &[]);
    let path = temp("netns.params");
    let coordinator = format!("{}:29517", net.addr(0));
    let job = format!("ns{}", net.tag);
    let all_finals = net.run(world, |rank| rank, &coordinator, &job, &[], &path);
    assert_eq!(all_finals.len(), 4, "{all_finals:?}");
    assert!(all_finals.iter().all(|f| f == &all_finals[0]));
    assert!(((all_finals[0].0 - want_loss) / want_loss).abs() <= 1e-6);
    assert_same_params(&params(&path), &want, "network namespaces");
}

impl Net {
    /// `embed` as ranks `0..world` over `tcp`, rank `r` in namespace `ns_of(r)`, with the shared
    /// flags and `extra`; every rank's final line once all succeeded.
    fn run(
        &self,
        world: u32,
        ns_of: impl Fn(u32) -> u32,
        coordinator: &str,
        job: &str,
        extra: &[&str],
        path: &std::path::Path,
    ) -> Vec<(f64, f64)> {
        let children: Vec<_> = (0..world)
            .map(|rank| {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", &self.ns(ns_of(rank))])
                    .arg(embed());
                let secret = "netns-secret-of-this-job";
                rank_env(&mut cmd, rank, world, coordinator, secret, job, "tcp");
                let per_host = (0..world).filter(|&r| ns_of(r) == ns_of(rank)).count();
                cmd.env("LOCAL_WORLD_SIZE", per_host.to_string());
                cmd.args(common_args())
                    .args(extra)
                    .arg("--save-params")
                    .arg(path);
                cmd.stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                cmd.spawn().expect("a rank starts in its namespace")
            })
            .collect();
        let mut all_finals = Vec::new();
        for (rank, child) in children.into_iter().enumerate() {
            let out = wait(child, Duration::from_secs(150));
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{extra:?}, rank {rank}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            all_finals.extend(finals(&stdout));
        }
        all_finals
    }

    /// Bytes that crossed namespace `r`'s link, both ways, so far (its host end's counters).
    fn link_bytes(&self, r: u32) -> u64 {
        ["rx_bytes", "tx_bytes"]
            .iter()
            .map(|c| {
                let path = format!("/sys/class/net/odc{}h{r}/statistics/{c}", self.tag);
                std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("{path} unreadable"))
            })
            .sum()
    }
}

/// Four ranks over `tcp` on a pair of namespaces standing for two hosts (ranks 0 and 1 on one,
/// 2 and 3 on the other, `LOCAL_WORLD_SIZE=2` as torchrun sets it): with pushes relayed through
/// the node (the default of a world that spans hosts; `--direct-pushes` the other side), training
/// equals one process's as without, and the bytes on the link between the two hosts fall by
/// about the node size (each host's relays cross it once per step instead of every
/// micro-batch's off-host pushes; the pulls and the control plane cross as before).
#[test]
fn relayed_pushes_over_a_namespace_pair_train_equal_and_cross_between_hosts_less() {
    let (hosts, world) = (2, 4);
    let net = match Net::make(hosts, 1) {
        Ok(net) => net,
        Err(reason) => {
            eprintln!("SKIPPED: network namespaces cannot be made here: {reason}");
            return;
        }
    };
    let (want, want_loss) = single(4, 4, &[]);
    let mut crossed = Vec::new();
    for relay in [false, true] {
        let path = temp(&format!("netns-relay-{relay}.params"));
        let coordinator = format!("{}:{}", net.addr(0), 29_520 + u32::from(relay));
        let job = format!("nsr{}{relay}", net.tag);
        let before = net.link_bytes(0) + net.link_bytes(1);
        // Relayed by default: each rank's launcher says 2 processes a host (torchrun's
        // LOCAL_WORLD_SIZE, set by `run`), below the world of 4.
        let extra: &[&str] = if relay { &[] } else { &["--direct-pushes"] };
        let all_finals = net.run(world, |rank| rank / 2, &coordinator, &job, extra, &path);
        assert_eq!(all_finals.len(), 4, "{all_finals:?}");
        assert!(all_finals.iter().all(|f| f == &all_finals[0]));
        assert!(((all_finals[0].0 - want_loss) / want_loss).abs() <= 1e-6);
        assert_same_params(&params(&path), &want, &format!("relayed {relay}"));
        crossed.push(net.link_bytes(0) + net.link_bytes(1) - before);
    }
    eprintln!(
        "bytes between the two hosts: direct pushes {}, relayed {}",
        crossed[0], crossed[1]
    );
    // Measured 2.04-2.06x: the pushes dominate this small model's traffic.
    assert!(
        crossed[1] * 9 <= crossed[0] * 5,
        "relays crossed {} bytes between hosts, direct pushes {}: not 1.8x fewer",
        crossed[1],
        crossed[0]
    );
}
