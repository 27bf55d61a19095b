//! (b) Four processes, each in its own network namespace with its own address (veth pairs on a
//! bridge), over `tcp`, train to the single-process parameters. Skipped, with the reason
//! printed, only where namespaces cannot be made (not root, no `ip`, no veth/bridge support).

use std::process::Command;
use std::time::Duration;

use crate::harness::*;

/// Namespaces, veths and a bridge, removed on drop.
struct Net {
    tag: String,
    world: u32,
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
    /// `world` namespaces `odc<tag>n<r>` with 10.231.<x>.<r+1>/24 on bridge `odc<tag>b`.
    fn make(world: u32) -> Result<Net, String> {
        let tag = format!("{}", std::process::id() % 100_000);
        let net = Net { tag, world };
        let bridge = net.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        for r in 0..world {
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
        for r in 0..self.world {
            let _ = ip(&["link", "del", &format!("odc{}h{r}", self.tag)]);
            let _ = ip(&["netns", "del", &self.ns(r)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

#[test]
fn four_processes_in_their_own_network_namespaces_train_to_the_single_process_parameters() {
    let world = 4;
    let net = match Net::make(world) {
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
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &net.ns(rank)]).arg(embed());
            rank_env(
                &mut cmd,
                rank,
                world,
                &coordinator,
                "netns-secret-of-this-job",
                &job,
                "tcp",
            );
            cmd.args(common_args()).arg("--save-params").arg(&path);
            cmd.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().expect("a rank starts in its namespace")
        })
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| wait(c, Duration::from_secs(150)))
        .collect();
    let mut all_finals = Vec::new();
    for (rank, out) in outs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        all_finals.extend(finals(&stdout));
    }
    assert_eq!(all_finals.len(), 4, "{all_finals:?}");
    assert!(all_finals.iter().all(|f| f == &all_finals[0]));
    assert!(((all_finals[0].0 - want_loss) / want_loss).abs() <= 1e-6);
    assert_same_params(&params(&path), &want, "network namespaces");
}
