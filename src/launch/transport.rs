//! The data-plane transport of a process in a multi-process job, from its [`World`]:
//! `ODC_TRANSPORT=shm` (processes of one host: regions in `/dev/shm`, named by `ODC_JOB`) or `tcp`
//! (the default across hosts: listens on [`World::bind_ip`], the interface that routes to the
//! coordinator, loopback when it is loopback, or `ODC_BIND`; advertises
//! [`World::advertise_ip`]) or `cuda` (processes of one host: regions in device memory read
//! through CUDA IPC, on device `local rank mod device count`, the local rank from
//! `ODC_LOCAL_RANK`, else torchrun's `LOCAL_RANK`, else Slurm's `SLURM_LOCALID`, else 0; only in
//! a build with the root crate's `cuda` feature, otherwise a clear error naming it). All
//! authenticate peers with the cluster secret (`ODC_SECRET`, at least 16 bytes).

use std::net::SocketAddr;
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

/// This process's transport: `ODC_TRANSPORT=shm`, `tcp` (the default for several processes) or
/// `cuda`; `local` alone.
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
        "tcp" => Ok(Arc::new(TcpTransport::bind(tcp_config(world)?).await?)),
        "cuda" => cuda_transport(world).await,
        other => Err(Error::Config(format!(
            "ODC_TRANSPORT={other:?}: expected shm, tcp or cuda (local for one process)"
        ))),
    }
}

/// This process's rank among the processes of its host: `ODC_LOCAL_RANK`, `LOCAL_RANK`
/// (torchrun), `SLURM_LOCALID`, else 0.
pub fn local_rank() -> u32 {
    local_rank_from(|name| std::env::var(name).ok())
}

/// This rank's CUDA device among `count`: `local_rank() mod count` (the `cuda` transport's, and
/// the Python package's GPU path's).
pub fn local_device(count: u32) -> u32 {
    local_rank() % count.max(1)
}

fn local_rank_from(get: impl Fn(&str) -> Option<String>) -> u32 {
    ["ODC_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|name| get(name)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The `cuda` backend on device `local_rank() mod device_count` (without a driver: the backend's
/// `no CUDA driver: …` error).
#[cfg(feature = "cuda-data")]
async fn cuda_transport(world: &World) -> Result<Arc<dyn Transport>> {
    use odc_transport::cuda::{device_count, CudaConfig, CudaTransport};
    let count = device_count()?;
    if count == 0 {
        return Err(Error::Config(
            "ODC_TRANSPORT=cuda: no CUDA driver: the driver sees no CUDA device".into(),
        ));
    }
    let device = local_device(count);
    let config = CudaConfig::new(device, job_name(world), secret(world)?);
    Ok(Arc::new(CudaTransport::new(config).await?))
}

/// A one-process job's `cuda` backend on device `ordinal` (its shard servers on that GPU,
/// [`crate::JobBuilder::servers_on_device`]): a job name of its own (`odc-<pid>-<n>`) and a fresh
/// secret, since nothing outside the process reaches it.
#[cfg(feature = "cuda-data")]
pub async fn device_transport(ordinal: u32) -> Result<Arc<dyn Transport>> {
    use odc_transport::cuda::{CudaConfig, CudaTransport};
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let job = format!("odc-{}-{n}", std::process::id());
    let config = CudaConfig::new(ordinal, job, ClusterSecret::random());
    Ok(Arc::new(CudaTransport::new(config).await?))
}

/// Without the `cuda` feature: the error naming it.
#[cfg(not(feature = "cuda-data"))]
pub async fn device_transport(ordinal: u32) -> Result<Arc<dyn Transport>> {
    Err(Error::Config(format!(
        "shard servers on CUDA device {ordinal}: this build of odc has no CUDA backend: build \
         the program with the root crate's `cuda` feature (see benches/gpu/build.sh)"
    )))
}

#[cfg(not(feature = "cuda-data"))]
async fn cuda_transport(_world: &World) -> Result<Arc<dyn Transport>> {
    Err(Error::Config(
        "ODC_TRANSPORT=cuda: this build of odc has no CUDA backend: build the program with the \
         root crate's `cuda` feature (`cargo build --release --features cuda`, see \
         benches/gpu/build.sh)"
            .into(),
    ))
}

/// The `tcp` transport's configuration: bind [`World::bind_ip`] at a free port, advertise
/// [`World::advertise_ip`].
fn tcp_config(world: &World) -> Result<TcpConfig> {
    let bind = world.bind_ip().map_err(|e| Error::Config(e.to_string()))?;
    let advertise = world
        .advertise_ip()
        .map_err(|e| Error::Config(e.to_string()))?;
    metrics::gauge!(INSECURE_FRAMES_METRIC).set(if world.insecure_frames { 1.0 } else { 0.0 });
    if world.insecure_frames {
        tracing::warn!(
            "ODC_INSECURE_FRAMES: rank {}'s frames between hosts are not authenticated (a byte              changed on the path goes unnoticed); unset it to seal them",
            world.rank
        );
    }
    Ok(TcpConfig {
        bind: SocketAddr::new(bind, 0).to_string(),
        advertise_host: Some(advertise.to_string()),
        secret: secret(world)?,
        remote: RemoteConfig {
            sealed_frames: !world.insecure_frames,
            ..RemoteConfig::default()
        },
    })
}

/// 1 where this process's data-plane frames between hosts travel unsealed
/// (`ODC_INSECURE_FRAMES=1`), else 0.
pub const INSECURE_FRAMES_METRIC: &str = "odc_insecure_frames";

#[cfg(test)]
mod tests {
    use super::*;

    fn world(vars: &[(&str, &str)]) -> World {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
            .expect("world")
    }

    const RANK_1_OF_2: [(&str, &str); 4] = [
        ("ODC_RANK", "1"),
        ("ODC_WORLD_SIZE", "2"),
        ("ODC_COORDINATOR", "127.0.0.1:29500"),
        ("ODC_SECRET", "0123456789abcdef0123456789abcdef"),
    ];

    #[test]
    fn tcp_listens_on_loopback_when_the_coordinator_is_loopback() {
        let config = tcp_config(&world(&RANK_1_OF_2)).expect("config");
        assert_eq!(config.bind, "127.0.0.1:0");
        assert_eq!(config.advertise_host.as_deref(), Some("127.0.0.1"));
        let mut vars = RANK_1_OF_2.to_vec();
        vars.push(("ODC_BIND", "::1"));
        let config = tcp_config(&world(&vars)).expect("config");
        assert_eq!(
            (config.bind.as_str(), config.advertise_host.as_deref()),
            ("[::1]:0", Some("::1"))
        );
    }

    /// Frames between hosts are sealed unless the job says `ODC_INSECURE_FRAMES=1`.
    #[test]
    fn tcp_seals_its_frames_unless_the_job_turns_it_off() {
        let sealed = tcp_config(&world(&RANK_1_OF_2)).expect("config");
        assert!(sealed.remote.sealed_frames);
        let mut vars = RANK_1_OF_2.to_vec();
        vars.push(("ODC_INSECURE_FRAMES", "1"));
        let insecure = tcp_config(&world(&vars)).expect("config");
        assert!(!insecure.remote.sealed_frames);
        let mut vars = RANK_1_OF_2.to_vec();
        vars.push(("ODC_INSECURE_FRAMES", "maybe"));
        let err = World::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
        .expect_err("not a yes or no");
        assert!(err.to_string().contains("ODC_INSECURE_FRAMES"), "{err}");
    }

    #[test]
    fn the_local_rank_comes_from_odc_then_torchrun_then_slurm() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank_from(env(&[])), 0);
        assert_eq!(local_rank_from(env(&[("SLURM_LOCALID", "3")])), 3);
        assert_eq!(
            local_rank_from(env(&[("LOCAL_RANK", "2"), ("SLURM_LOCALID", "3")])),
            2
        );
        assert_eq!(
            local_rank_from(env(&[("ODC_LOCAL_RANK", "1"), ("LOCAL_RANK", "2")])),
            1
        );
        assert_eq!(local_rank_from(env(&[("ODC_LOCAL_RANK", "x")])), 0);
    }

    #[cfg(not(feature = "cuda-data"))]
    #[test]
    fn cuda_without_the_feature_names_it() {
        let mut vars = RANK_1_OF_2.to_vec();
        vars.push(("ODC_TRANSPORT", "cuda"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let e = rt
            .block_on(transport(&world(&vars)))
            .err()
            .expect("no cuda backend in this build")
            .to_string();
        assert!(e.contains("`cuda` feature"), "{e}");
    }

    #[test]
    fn a_short_secret_is_refused_with_how_to_make_one() {
        let mut vars = RANK_1_OF_2.to_vec();
        vars[3] = ("ODC_SECRET", "hunter2");
        let e = secret(&world(&vars)).expect_err("7 bytes");
        let text = e.to_string();
        assert!(
            text.contains("ODC_SECRET") && text.contains("openssl rand -hex 32"),
            "{text}"
        );
        assert!(
            !text.contains("hunter2"),
            "the error does not show the secret: {text}"
        );
    }
}
