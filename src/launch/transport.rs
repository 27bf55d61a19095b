//! The data-plane transport of a process in a multi-process job, from its [`World`]:
//! `ODC_TRANSPORT=shm` (processes of one host: regions in `/dev/shm`, named by `ODC_JOB`) or `tcp`
//! (the default across hosts: listens on every interface, advertises the address this host uses
//! to reach the coordinator). Both authenticate peers with the cluster secret (`ODC_SECRET`).

use std::net::UdpSocket;
use std::sync::Arc;

use odc_actors::{Error, Result};
use odc_transport::local::LocalTransport;
use odc_transport::shm::{ShmConfig, ShmTransport};
use odc_transport::tcp::{TcpConfig, TcpTransport};
use odc_transport::{ClusterSecret, RemoteConfig, Transport};

use super::World;

/// The cluster secret of a multi-process world (`ODC_SECRET`, required there).
pub fn secret(world: &World) -> Result<ClusterSecret> {
    let text = world.secret.as_deref().ok_or_else(|| {
        Error::Config(format!(
            "ODC_SECRET is not set: a job of {} processes needs the cluster secret (odc launch \
             sets a fresh one; with torchrun or Slurm export the same ODC_SECRET to every rank)",
            world.world_size
        ))
    })?;
    ClusterSecret::new(text).map_err(|e| Error::Config(format!("ODC_SECRET: {e}")))
}

/// The job's name (`ODC_JOB`, or `odc`).
pub fn job_name(world: &World) -> String {
    world.job.clone().unwrap_or_else(|| "odc".into())
}

/// This process's transport: `ODC_TRANSPORT=shm` or `tcp` (the default for several processes), `local` alone.
pub async fn transport(world: &World) -> Result<Arc<dyn Transport>> {
    let kind = world
        .transport
        .as_deref()
        .unwrap_or(if world.world_size > 1 { "tcp" } else { "local" });
    match kind {
        "local" if world.world_size == 1 => Ok(Arc::new(LocalTransport::new())),
        "local" => Err(Error::Config(format!(
            "ODC_TRANSPORT=local reaches no other process; a job of {} processes needs shm or tcp",
            world.world_size
        ))),
        "shm" => {
            let config = ShmConfig::new(job_name(world), secret(world)?);
            Ok(Arc::new(ShmTransport::new(config).await?))
        }
        "tcp" => {
            let config = TcpConfig {
                bind: "0.0.0.0:0".into(),
                advertise_host: Some(local_host(world)),
                secret: secret(world)?,
                remote: RemoteConfig::default(),
            };
            Ok(Arc::new(TcpTransport::bind(config).await?))
        }
        other => Err(Error::Config(format!(
            "ODC_TRANSPORT={other:?}: expected shm or tcp (local for one process)"
        ))),
    }
}

/// Where this process's control-plane listener binds (rank 0; its port is the coordinator's):
/// `ODC_BIND` when set, else the interface that routes to the coordinator (loopback when the
/// coordinator is loopback).
pub fn bind_ip(world: &World) -> Result<std::net::IpAddr> {
    if let Ok(bind) = std::env::var("ODC_BIND") {
        return bind
            .trim()
            .parse()
            .map_err(|e| Error::Config(format!("ODC_BIND={bind:?} is not an IP address: {e}")));
    }
    local_host(world)
        .parse()
        .map_err(|e| Error::Config(format!("no address to bind: {e}")))
}

/// The address of the interface this host reaches the coordinator through (no packet is sent:
/// connecting a UDP socket only picks the route); loopback without a coordinator.
fn local_host(world: &World) -> String {
    let Some(coordinator) = world.coordinator.as_deref() else {
        return "127.0.0.1".into();
    };
    UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect(coordinator).map(|()| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}
