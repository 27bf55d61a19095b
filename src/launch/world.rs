//! Which process of which job this is: rank, world size and coordinator, read from the
//! environment the way the usual launchers set it.
//!
//! Sources, first match wins (a process started by `odc launch` inside a Slurm or torchrun
//! allocation sees all three; odc's own variables are the most specific):
//! 1. **odc**: `ODC_RANK`, `ODC_WORLD_SIZE`, `ODC_COORDINATOR` (`host:port`; needed when the world
//!    has more than one process).
//! 2. **torchrun**: `RANK`, `WORLD_SIZE`, and the coordinator at `MASTER_ADDR`, port `ODC_PORT`,
//!    else `MASTER_PORT + 1`: torchrun's own rendezvous store listens on `MASTER_PORT` (and
//!    `torch.distributed` joins it there), so odc takes the next port.
//! 3. **Slurm**: `SLURM_PROCID`, `SLURM_NTASKS`, and the coordinator on the first host of
//!    `SLURM_NODELIST` (e.g. `gpu[03-05,9]` → `gpu03`) at `ODC_PORT`, else `MASTER_PORT`, else
//!    [`DEFAULT_PORT`].
//! 4. Nothing set: one process, rank 0 of 1.
//!
//! Also read when present: `ODC_SECRET` (the cluster secret), `ODC_JOB` (the job id, used to
//! name shared-memory files), `ODC_TRANSPORT` (`local`, `shm`, `tcp`), `ODC_BIND` (the IP
//! address this process's listeners bind, see [`World::bind_ip`]) and the processes per host
//! (`ODC_LOCAL_WORLD_SIZE`, torchrun's `LOCAL_WORLD_SIZE` or Slurm's `SLURM_NTASKS_PER_NODE`:
//! [`World::hosts`], which decides whether a job relays its pushes by default).
//!
//! Every value is checked: a rank that is not a number, a rank not below the world size, a world
//! of 0 or of more than [`MAX_WORLD`] processes, a coordinator without a port are errors naming
//! the variable and its value.
//!
//! Listeners bind one address ([`World::bind_ip`]): `ODC_BIND` if set, else the address of the
//! interface that routes to the coordinator: loopback when the coordinator is loopback, so a
//! job on one host is not reachable from the network at all.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// The port of a Slurm job's coordinator when neither `ODC_PORT` nor `MASTER_PORT` says.
pub const DEFAULT_PORT: u16 = 29_500;
/// The largest world accepted.
pub const MAX_WORLD: u32 = 65_536;

/// Where the rank came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorldSource {
    Odc,
    Torchrun,
    Slurm,
    /// No launcher: one process.
    Single,
}

impl fmt::Display for WorldSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorldSource::Odc => "ODC_RANK/ODC_WORLD_SIZE",
            WorldSource::Torchrun => "torchrun (RANK/WORLD_SIZE)",
            WorldSource::Slurm => "Slurm (SLURM_PROCID/SLURM_NTASKS)",
            WorldSource::Single => "no launcher (one process)",
        })
    }
}

/// This process's place in its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub rank: u32,
    pub world_size: u32,
    /// `host:port` of rank 0's control plane; `None` only for a world of one.
    pub coordinator: Option<String>,
    pub source: WorldSource,
    /// `ODC_SECRET`, if set.
    pub secret: Option<String>,
    /// `ODC_JOB`, if set.
    pub job: Option<String>,
    /// `ODC_TRANSPORT`, if set.
    pub transport: Option<String>,
    /// `ODC_BIND`, if set: the address listeners bind ([`World::bind_ip`]).
    pub bind: Option<IpAddr>,
    /// Processes per host, if the launcher says ([`local_world_size`]): ranks `n·L .. (n+1)·L`
    /// on host `n`, as torchrun and Slurm's block distribution number them.
    pub local_world_size: Option<u32>,
    /// `ODC_INSECURE_FRAMES=1`: frames between hosts travel unsealed (`odc_transport::wire::sealed`
    /// off: no per-frame authentication), for clusters that want the bytes back. Every process
    /// of the job must agree; it is logged and counted (`odc_insecure_frames`).
    pub insecure_frames: bool,
}

/// A launcher variable with a value odc cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value:?}: {reason}")]
pub struct WorldError {
    pub variable: String,
    pub value: String,
    pub reason: String,
}

fn bad(variable: &str, value: &str, reason: impl Into<String>) -> WorldError {
    WorldError {
        variable: variable.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

impl World {
    /// Read the process environment.
    pub fn from_env() -> Result<World, WorldError> {
        World::from_vars(|name| std::env::var(name).ok())
    }

    /// Read variables through `get` (the environment, or a map in tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<World, WorldError> {
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let (rank, world_size, coordinator, source) = if let Some(rank) = get("ODC_RANK") {
            let (rank, size) = rank_and_size(&get, ("ODC_RANK", &rank), "ODC_WORLD_SIZE")?;
            let coordinator = match get("ODC_COORDINATOR") {
                Some(c) => Some(host_port("ODC_COORDINATOR", &c)?),
                None => None,
            };
            (rank, size, coordinator, WorldSource::Odc)
        } else if let Some(rank) = get("RANK") {
            let (rank, size) = rank_and_size(&get, ("RANK", &rank), "WORLD_SIZE")?;
            let coordinator = match (get("MASTER_ADDR"), get("MASTER_PORT")) {
                (Some(addr), Some(port)) => Some(join(&addr, torchrun_port(&get, &port)?)),
                (None, None) => None,
                (Some(addr), None) => {
                    return Err(bad("MASTER_ADDR", &addr, "set without MASTER_PORT"))
                }
                (None, Some(port)) => {
                    return Err(bad("MASTER_PORT", &port, "set without MASTER_ADDR"))
                }
            };
            (rank, size, coordinator, WorldSource::Torchrun)
        } else if let Some(rank) = get("SLURM_PROCID") {
            let (rank, size) = rank_and_size(&get, ("SLURM_PROCID", &rank), "SLURM_NTASKS")?;
            let coordinator = match get("SLURM_NODELIST").or_else(|| get("SLURM_JOB_NODELIST")) {
                Some(list) => {
                    let host = first_host(&list).map_err(|r| bad("SLURM_NODELIST", &list, r))?;
                    let port = match get("ODC_PORT")
                        .map(|p| ("ODC_PORT", p))
                        .or_else(|| get("MASTER_PORT").map(|p| ("MASTER_PORT", p)))
                    {
                        Some((name, port)) => port_number(name, &port)?,
                        None => DEFAULT_PORT,
                    };
                    Some(join(&host, port))
                }
                None => None,
            };
            (rank, size, coordinator, WorldSource::Slurm)
        } else {
            (0, 1, None, WorldSource::Single)
        };
        if world_size > 1 && coordinator.is_none() {
            return Err(bad(
                coordinator_variable(source),
                "",
                format!(
                    "a world of {world_size} processes needs rank 0's address ({source} gave none)"
                ),
            ));
        }
        Ok(World {
            rank,
            world_size,
            coordinator,
            source,
            secret: get("ODC_SECRET"),
            job: get("ODC_JOB"),
            transport: get("ODC_TRANSPORT"),
            bind: match get("ODC_BIND") {
                Some(text) => Some(text.trim().parse::<IpAddr>().map_err(|e| {
                    bad(
                        "ODC_BIND",
                        &text,
                        format!(
                            "not an IP address ({e}): set it to the address of this host's \
                             interface that the other ranks reach, e.g. 10.0.0.5"
                        ),
                    )
                })?),
                None => None,
            },
            local_world_size: local_world_size(&get)?,
            insecure_frames: flag(&get, "ODC_INSECURE_FRAMES")?,
        })
    }

    /// The hosts the world spans: `⌈world size / local world size⌉`, 1 where the local world
    /// size is unknown.
    pub fn hosts(&self) -> u32 {
        match self.local_world_size {
            Some(local) if local > 0 => self.world_size.div_ceil(local),
            _ => 1,
        }
    }

    /// Whether this process is rank 0 (hosts the supervisor).
    pub fn is_coordinator(&self) -> bool {
        self.rank == 0
    }

    /// The IP address this process's listeners bind (port 0: any free port): `ODC_BIND` if set,
    /// else the address of the interface this host reaches the coordinator through (found by
    /// connecting a UDP socket, which sends nothing). Loopback when the coordinator is loopback
    /// or there is none (a world of one), so a job on one host listens on no network interface.
    /// An error names the coordinator's variable when its host does not resolve or no route
    /// leads there.
    pub fn bind_ip(&self) -> Result<IpAddr, WorldError> {
        match self.bind {
            Some(ip) => Ok(ip),
            None => self.route_ip(),
        }
    }

    /// The IP address peers dial to reach this process's listeners: [`World::bind_ip`], unless
    /// that is `ODC_BIND=0.0.0.0` (or `::`, every interface), then the interface that routes to
    /// the coordinator.
    pub fn advertise_ip(&self) -> Result<IpAddr, WorldError> {
        match self.bind_ip()? {
            ip if ip.is_unspecified() => self.route_ip(),
            ip => Ok(ip),
        }
    }

    /// The local address of the route to the coordinator (loopback without one).
    fn route_ip(&self) -> Result<IpAddr, WorldError> {
        let Some(coordinator) = self.coordinator.as_deref() else {
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        };
        let fail = |reason: String| {
            bad(
                coordinator_variable(self.source),
                coordinator,
                format!("{reason}; set ODC_BIND to this host's address"),
            )
        };
        let target = coordinator
            .to_socket_addrs()
            .map_err(|e| fail(format!("cannot resolve the coordinator: {e}")))?
            .next()
            .ok_or_else(|| fail("the coordinator resolves to no address".into()))?;
        let any = match target {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        UdpSocket::bind(SocketAddr::new(any, 0))
            .and_then(|socket| socket.connect(target).map(|()| socket))
            .and_then(|socket| socket.local_addr())
            .map(|local| local.ip())
            .map_err(|e| fail(format!("no route to the coordinator at {target}: {e}")))
    }
}

/// Processes per host: `ODC_LOCAL_WORLD_SIZE` (`odc launch`), else torchrun's
/// `LOCAL_WORLD_SIZE`, else Slurm's `SLURM_NTASKS_PER_NODE` where it is one number (a list such
/// as `2(x3),1` says nothing about an even split, and is not used). Unset: unknown. 0 or not a
/// number is an error naming the variable.
fn local_world_size(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u32>, WorldError> {
    for name in ["ODC_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"] {
        if let Some(text) = get(name) {
            return match text.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(bad(
                    name,
                    &text,
                    "expected the number of processes per host, at least 1",
                )),
            };
        }
    }
    Ok(get("SLURM_NTASKS_PER_NODE")
        .and_then(|t| t.trim().parse::<u32>().ok())
        .filter(|&n| n > 0))
}

/// A yes-or-no variable: `1`/`true`/`yes` or `0`/`false`/`no` (unset: no); anything else is an
/// error naming it.
fn flag(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<bool, WorldError> {
    match get(name) {
        None => Ok(false),
        Some(text) => match text.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" => Ok(true),
            "0" | "false" | "no" => Ok(false),
            _ => Err(bad(name, &text, "expected 1 or 0 (true or false)")),
        },
    }
}

/// The variable that names the coordinator for a launcher.
fn coordinator_variable(source: WorldSource) -> &'static str {
    match source {
        WorldSource::Odc | WorldSource::Single => "ODC_COORDINATOR",
        WorldSource::Torchrun => "MASTER_ADDR",
        WorldSource::Slurm => "SLURM_NODELIST",
    }
}

fn rank_and_size(
    get: &impl Fn(&str) -> Option<String>,
    (rank_name, rank): (&str, &str),
    size_name: &str,
) -> Result<(u32, u32), WorldError> {
    let size_text = get(size_name).ok_or_else(|| {
        bad(
            rank_name,
            rank,
            format!("set without {size_name} (the number of processes)"),
        )
    })?;
    let rank_n: u32 = rank
        .trim()
        .parse()
        .map_err(|_| bad(rank_name, rank, "not a non-negative integer"))?;
    let size: u32 = size_text
        .trim()
        .parse()
        .map_err(|_| bad(size_name, &size_text, "not a positive integer"))?;
    if size == 0 || size > MAX_WORLD {
        return Err(bad(
            size_name,
            &size_text,
            format!("must be between 1 and {MAX_WORLD}"),
        ));
    }
    if rank_n >= size {
        return Err(bad(
            rank_name,
            rank,
            format!("must be below {size_name}={size}"),
        ));
    }
    Ok((rank_n, size))
}

fn port_number(variable: &str, text: &str) -> Result<u16, WorldError> {
    match text.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(bad(variable, text, "not a port number (1-65535)")),
    }
}

/// The coordinator's port in a torchrun world: `ODC_PORT`, else the port after `MASTER_PORT`
/// (which torchrun's rendezvous store holds).
fn torchrun_port(
    get: &impl Fn(&str) -> Option<String>,
    master_port: &str,
) -> Result<u16, WorldError> {
    if let Some(port) = get("ODC_PORT") {
        return port_number("ODC_PORT", &port);
    }
    let port = port_number("MASTER_PORT", master_port)?;
    port.checked_add(1).ok_or_else(|| {
        bad(
            "MASTER_PORT",
            master_port,
            "odc's coordinator takes MASTER_PORT + 1, past 65535: set ODC_PORT",
        )
    })
}

/// `host:port`, bracketing an IPv6 literal.
fn join(host: &str, port: u16) -> String {
    let host = host.trim();
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Check `text` is `host:port` with a valid port.
fn host_port(variable: &str, text: &str) -> Result<String, WorldError> {
    let text = text.trim();
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(bad(variable, text, "expected host:port"));
    };
    if host.is_empty() || host == "[]" {
        return Err(bad(
            variable,
            text,
            "expected host:port (the host is empty)",
        ));
    }
    port_number(variable, port)?;
    Ok(text.to_owned())
}

/// The first host of a Slurm node list: `a[01-03,7],b` → `a01`; `c5` → `c5`; `n[1-2]-ib[3-4]` →
/// `n1-ib3`.
pub fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    // The first top-level item: up to a comma outside brackets.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced or nested brackets".into());
        }
    }
    if depth != 0 {
        return Err("unbalanced brackets".into());
    }
    let item = &list[..end];
    if item.is_empty() {
        return Err("the node list is empty".into());
    }
    // Replace each bracket group by its first number, as written (zero padding kept).
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or("unbalanced brackets")?;
        let group = &rest[open + 1..close];
        let first = group
            .split(',')
            .next()
            .and_then(|range| range.split('-').next())
            .map(str::trim)
            .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
            .ok_or_else(|| format!("bracket group [{group}] is not a list of numbers"))?;
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    Ok(host)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn world(vars: &[(&str, &str)]) -> Result<World, WorldError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn nothing_set_is_one_process() {
        let w = world(&[]).expect("world");
        assert_eq!(
            (w.rank, w.world_size, w.source),
            (0, 1, WorldSource::Single)
        );
        assert_eq!(w.coordinator, None);
    }

    #[test]
    fn processes_per_host_come_from_odc_torchrun_or_slurm_and_are_checked() {
        let base = [
            ("RANK", "3"),
            ("WORLD_SIZE", "16"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "1"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut vars = base.to_vec();
            vars.extend_from_slice(extra);
            world(&vars)
        };
        let unknown = with(&[]).expect("world");
        assert_eq!((unknown.local_world_size, unknown.hosts()), (None, 1));
        let torchrun = with(&[("LOCAL_WORLD_SIZE", "4")]).expect("world");
        assert_eq!((torchrun.local_world_size, torchrun.hosts()), (Some(4), 4));
        let odc = with(&[("ODC_LOCAL_WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "4")]).expect("world");
        assert_eq!(
            (odc.local_world_size, odc.hosts()),
            (Some(8), 2),
            "odc's variable wins"
        );
        let slurm = with(&[("SLURM_NTASKS_PER_NODE", "5")]).expect("world");
        assert_eq!(
            (slurm.local_world_size, slurm.hosts()),
            (Some(5), 4),
            "the last host holds 1"
        );
        let uneven = with(&[("SLURM_NTASKS_PER_NODE", "2(x3),1")]).expect("world");
        assert_eq!(
            uneven.local_world_size, None,
            "a Slurm list is no even split"
        );
        for bad in ["0", "x", "-1"] {
            let vars = [("LOCAL_WORLD_SIZE", bad)];
            let err = with(&vars).expect_err(bad);
            assert_eq!(err.variable, "LOCAL_WORLD_SIZE", "{err}");
        }
    }

    #[test]
    fn odc_variables_win_over_torchrun_and_slurm() {
        let w = world(&[
            ("ODC_RANK", "2"),
            ("ODC_WORLD_SIZE", "4"),
            ("ODC_COORDINATOR", "10.0.0.1:7000"),
            ("ODC_SECRET", "s"),
            ("ODC_JOB", "j"),
            ("ODC_TRANSPORT", "shm"),
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
        ])
        .expect("world");
        assert_eq!((w.rank, w.world_size, w.source), (2, 4, WorldSource::Odc));
        assert_eq!(w.coordinator.as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(
            (
                w.secret.as_deref(),
                w.job.as_deref(),
                w.transport.as_deref()
            ),
            (Some("s"), Some("j"), Some("shm"))
        );
    }

    #[test]
    fn torchrun_variables() {
        let w = world(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29400"),
        ])
        .expect("world");
        assert_eq!(
            (w.rank, w.world_size, w.source),
            (3, 4, WorldSource::Torchrun)
        );
        // torchrun's store holds MASTER_PORT: odc's coordinator is on the next port.
        assert_eq!(w.coordinator.as_deref(), Some("node7:29401"));
        let v6 = world(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "5"),
        ])
        .expect("world");
        assert_eq!(v6.coordinator.as_deref(), Some("[::1]:6"));
        let chosen = world(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29400"),
            ("ODC_PORT", "31000"),
        ])
        .expect("world");
        assert_eq!(chosen.coordinator.as_deref(), Some("node7:31000"));
        let last = world(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "65535"),
        ]);
        assert!(last.unwrap_err().to_string().contains("ODC_PORT"));
    }

    #[test]
    fn slurm_variables_and_node_lists() {
        let w = world(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NODELIST", "gpu[03-05,9],cpu1"),
        ])
        .expect("world");
        assert_eq!((w.rank, w.world_size, w.source), (1, 8, WorldSource::Slurm));
        assert_eq!(w.coordinator.as_deref(), Some("gpu03:29500"));
        let with_port = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "a1"),
            ("MASTER_PORT", "1234"),
        ])
        .expect("world");
        assert_eq!(with_port.coordinator.as_deref(), Some("a1:1234"));
        assert_eq!(first_host("n[1-2]-ib[3-4]"), Ok("n1-ib3".into()));
        assert_eq!(first_host("solo"), Ok("solo".into()));
        assert!(first_host("a[1-2").is_err());
        assert!(first_host("a[x]").is_err());
        assert!(first_host("").is_err());
        assert!(first_host("a[[1]]").is_err());
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("ODC_RANK", "1")], "ODC_RANK"),
            (&[("ODC_RANK", "x"), ("ODC_WORLD_SIZE", "2")], "ODC_RANK"),
            (&[("ODC_RANK", "2"), ("ODC_WORLD_SIZE", "2")], "ODC_RANK"),
            (
                &[("ODC_RANK", "0"), ("ODC_WORLD_SIZE", "0")],
                "ODC_WORLD_SIZE",
            ),
            (
                &[("ODC_RANK", "0"), ("ODC_WORLD_SIZE", "99999999")],
                "ODC_WORLD_SIZE",
            ),
            (
                &[("ODC_RANK", "0"), ("ODC_WORLD_SIZE", "2")],
                "ODC_COORDINATOR",
            ),
            (
                &[
                    ("ODC_RANK", "0"),
                    ("ODC_WORLD_SIZE", "2"),
                    ("ODC_COORDINATOR", "nohost"),
                ],
                "ODC_COORDINATOR",
            ),
            (
                &[
                    ("ODC_RANK", "0"),
                    ("ODC_WORLD_SIZE", "2"),
                    ("ODC_COORDINATOR", "h:99999"),
                ],
                "ODC_COORDINATOR",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "MASTER_ADDR",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_NODELIST", "a[1"),
                ],
                "SLURM_NODELIST",
            ),
        ];
        for (vars, variable) in cases {
            match world(vars) {
                Err(e) => assert_eq!(e.variable, *variable, "{vars:?}: {e}"),
                Ok(w) => panic!("{vars:?} accepted as {w:?}"),
            }
        }
    }

    #[test]
    fn listeners_bind_loopback_when_the_coordinator_is_loopback() {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let w = world(&[
            ("ODC_RANK", "1"),
            ("ODC_WORLD_SIZE", "2"),
            ("ODC_COORDINATOR", "127.0.0.1:7000"),
        ])
        .expect("world");
        assert_eq!(w.bind_ip().expect("bind"), loopback);
        assert_eq!(w.advertise_ip().expect("advertise"), loopback);
        let w = World {
            coordinator: Some("localhost:7000".into()),
            ..world(&[]).expect("world")
        };
        assert!(w.bind_ip().expect("bind").is_loopback());
        assert_eq!(
            world(&[]).expect("world").bind_ip().expect("bind"),
            loopback
        );
    }

    #[test]
    fn odc_bind_overrides_the_route_and_is_checked() {
        let w = world(&[
            ("ODC_RANK", "0"),
            ("ODC_WORLD_SIZE", "2"),
            ("ODC_COORDINATOR", "127.0.0.1:7000"),
            ("ODC_BIND", " 10.1.2.3 "),
        ])
        .expect("world");
        let ip: IpAddr = "10.1.2.3".parse().expect("ip");
        assert_eq!((w.bind_ip(), w.advertise_ip()), (Ok(ip), Ok(ip)));
        // Every interface: peers are told the one that routes to the coordinator.
        let w = world(&[("ODC_BIND", "0.0.0.0")]).expect("world");
        assert!(w.bind_ip().expect("bind").is_unspecified());
        assert_eq!(w.advertise_ip(), Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let w = world(&[("ODC_BIND", "::1")]).expect("world");
        assert_eq!(w.bind_ip(), Ok(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        for bad in ["gpu03", "10.0.0.1:7000", "10.0.0.256"] {
            let e = world(&[("ODC_BIND", bad)]).expect_err("not an IP address");
            assert_eq!((e.variable.as_str(), e.value.as_str()), ("ODC_BIND", bad));
            assert!(e.to_string().contains("not an IP address"), "{e}");
        }
    }

    #[test]
    fn an_unresolvable_coordinator_names_its_variable_and_odc_bind() {
        // (No port: refused before any name lookup, so the test needs no resolver.)
        let w = World {
            coordinator: Some("gpu03".into()),
            ..world(&[]).expect("world")
        };
        let e = w.bind_ip().expect_err("does not resolve");
        assert_eq!(e.variable, "ODC_COORDINATOR");
        assert!(e.to_string().contains("set ODC_BIND"), "{e}");
    }

    #[test]
    fn one_process_needs_no_coordinator() {
        let w = world(&[("ODC_RANK", "0"), ("ODC_WORLD_SIZE", "1")]).expect("world");
        assert_eq!((w.rank, w.world_size, w.coordinator), (0, 1, None));
    }
}
