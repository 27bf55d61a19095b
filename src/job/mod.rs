//! A training job: [`Job::builder`] configures it ([`builder`]), [`Job::run`] / [`Job::step`]
//! train and return per-step stats, [`Job::parameters`] and [`Job::train_state`] read it out
//! over the data plane ([`readout`]).

use std::sync::Arc;
use std::time::Duration;

use odc_actors::batch::SampleMeta;
use odc_actors::cluster::ClusterConfig;
use odc_actors::datapath::CollectiveGroup;
use odc_actors::layout::ModelLayout;
use odc_actors::messages::SupervisorSpec;
use odc_actors::node::{Node, TrainerTransport};
use odc_actors::policy::clock::Clock;
use odc_actors::policy::dispatch::Communication;
use odc_actors::policy::membership::HeartbeatConfig;
use odc_actors::policy::stats::StepStats;
use odc_actors::policy::step::StepError;
use odc_actors::supervisor::{RankPlacement, Supervisor, SupervisorArgs, SupervisorMsg};
use odc_actors::trainer::SharedComputeFactory;
use odc_actors::{Error, Result};
use odc_transport::local::LocalTransport;
use odc_transport::Transport;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::data::DataSource;
use crate::launch::{Roles, World};
use multi::MultiProcess;

mod builder;
mod checkpoint;
mod multi;
mod readout;
#[cfg(test)]
mod tests;

pub use builder::{JobBuilder, Precision, DEFAULT_STEP_TIMEOUT};

/// What [`Job`] starts on first use.
struct Setup {
    spec: SupervisorSpec,
    layout: Arc<ModelLayout>,
    compute: SharedComputeFactory,
    transport: Option<Arc<dyn Transport>>,
    trainer_transport: Option<TrainerTransport>,
    server_transport: Option<TrainerTransport>,
    servers_on_device: Option<u32>,
    collective_node_size: u32,
    clock: Arc<dyn Clock>,
    multi: Option<Multi>,
}

/// A multi-process job's world and roles.
struct Multi {
    world: World,
    roles: Roles,
    join_timeout: Duration,
    heartbeat: HeartbeatConfig,
}

/// A training job: actors are spawned on first use and live until [`Job::shutdown`].
pub struct Job {
    setup: Option<Setup>,
    /// This process's resources, once started.
    node: Option<Arc<Node>>,
    /// This process's part in a multi-process job.
    membership: Option<MultiProcess>,
    data: Option<Box<dyn DataSource>>,
    /// The supervisor (this process hosts it: a single-process job, or rank 0).
    supervisor: Option<(ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>)>,
    step: u64,
    step_timeout: Duration,
    parameters_timeout: Duration,
    join_timeout: Duration,
    /// The checkpoint being written in the background ([`Job::checkpoint_async`]).
    checkpoint: Option<tokio::task::JoinHandle<Result<std::path::PathBuf>>>,
    /// Step directories each host keeps once a checkpoint is published (0: all).
    keep_last: usize,
}

impl Job {
    pub fn builder() -> JobBuilder {
        JobBuilder::default()
    }

    /// This process's rank (0 in a single-process job).
    pub fn rank(&self) -> u32 {
        self.membership.as_ref().map_or(0, |m| m.rank)
    }

    /// Whether this process feeds the data and hosts the supervisor (rank 0).
    fn drives(&self) -> bool {
        self.rank() == 0
    }

    /// Start this process's part: its transport and node; in a multi-process job join the
    /// others; on rank 0 (or alone) the supervisor, which starts the servers and trainers.
    async fn start(&mut self) -> Result<()> {
        let Some(setup) = self.setup.take() else {
            return match (&self.node, &self.supervisor, &self.membership) {
                (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Ok(()),
                _ => Err(Error::Step(StepError::Actor {
                    actor: "supervisor".into(),
                    reason: "the job's actors stopped".into(),
                })),
            };
        };
        let Setup {
            spec,
            layout,
            compute,
            transport,
            trainer_transport,
            server_transport,
            servers_on_device,
            collective_node_size,
            clock,
            multi,
        } = setup;
        let transport = match (transport, &multi) {
            (Some(t), _) => t,
            (None, Some(m)) => crate::launch::transport(&m.world).await?,
            (None, None) => match servers_on_device {
                Some(ordinal) => crate::launch::device_transport(ordinal).await?,
                None => Arc::new(LocalTransport::new()),
            },
        };
        // The group of trainer inboxes: the collective's rings, or (on demand) the gangs of a job
        // that splits samples.
        let collective = spec.step.communication == Communication::Collective
            || spec.step.split != odc_actors::policy::split::SplitPolicy::Off;
        let node = Arc::new(Node {
            transport,
            layout: layout.clone(),
            compute,
            collective: collective.then(|| {
                Arc::new(CollectiveGroup::new(spec.trainers).with_node_size(collective_node_size))
            }),
            clock,
            trainer_transport,
            server_transport,
        });
        self.node = Some(node.clone());
        let mut placement = None;
        if let Some(Multi {
            world,
            roles,
            join_timeout,
            heartbeat,
        }) = multi
        {
            let config = ClusterConfig {
                job: crate::launch::job_name(&world),
                rank: world.rank,
                world_size: world.world_size,
                coordinator: world.coordinator.clone().unwrap_or_default(),
                secret: crate::launch::secret(&world)?,
                bind: world.bind_ip().map_err(|e| Error::Config(e.to_string()))?,
                join_timeout,
                heartbeat,
            };
            // Every peer costs a descriptor: raise the soft limit to the hard one first.
            match crate::launch::raise_fd_limit() {
                Ok(limit) => tracing::debug!("rank {}: up to {limit} descriptors", world.rank),
                Err(e) => tracing::warn!(
                    "rank {}: could not raise the descriptor limit: {e}",
                    world.rank
                ),
            }
            let membership = MultiProcess::join(config, node.clone()).await?;
            if membership.rank == 0 {
                placement = Some(RankPlacement {
                    job: membership.job.clone(),
                    hosts: membership.hosts.clone(),
                    server_ranks: roles.server_ranks,
                    trainer_ranks: roles.trainer_ranks,
                    layout: layout.digest(),
                    spawn_timeout: join_timeout,
                });
            }
            self.membership = Some(membership);
        }
        if !self.drives() {
            return Ok(());
        }
        let args = SupervisorArgs {
            spec,
            node,
            placement,
        };
        let (actor, handle) = Actor::spawn(None, Supervisor, args).await.map_err(|e| {
            Error::Step(StepError::Actor {
                actor: "supervisor".into(),
                reason: e.to_string(),
            })
        })?;
        self.supervisor = Some((actor, handle));
        Ok(())
    }

    /// The supervisor: this process's, or rank 0's seen from another rank.
    async fn supervisor(&mut self) -> Result<ActorRef<SupervisorMsg>> {
        self.start().await?;
        if let Some((actor, _)) = &self.supervisor {
            return Ok(actor.clone());
        }
        match &self.membership {
            Some(m) => m.supervisor().await,
            None => Err(Error::Internal("a job without a supervisor".into())),
        }
    }

    /// Train one minibatch of explicit samples (rank 0 of a multi-process job, or a
    /// single-process job). Waits at most the step timeout ([`JobBuilder::step_timeout`]); past
    /// it `Error::Step(StepError::Deadline)` (the step may still be running in the supervisor: the
    /// next call then gets `Error::Step(StepError::Busy)` until it ends).
    pub async fn step_with(&mut self, samples: Vec<SampleMeta>) -> Result<StepStats> {
        self.start().await?;
        if !self.drives() {
            return Err(Error::Config(format!(
                "rank {}: only rank 0 feeds samples; other ranks call Job::step",
                self.rank()
            )));
        }
        let supervisor = self.supervisor().await?;
        let timeout = self.step_timeout;
        let reply = supervisor
            .call(|reply| SupervisorMsg::Step(samples, reply), Some(timeout))
            .await;
        let stats = unwrap_call(reply, "step", self.step, timeout).and_then(|r| r);
        if let Some(m) = &self.membership {
            m.broadcast_step(self.step, &stats).await;
        }
        let stats = stats?;
        self.step += 1;
        Ok(stats)
    }

    /// Train one minibatch from the data source. On ranks other than 0 of a multi-process job:
    /// wait for rank 0's step and return its outcome (without the per-micro-batch log, which
    /// only rank 0 keeps).
    pub async fn step(&mut self) -> Result<StepStats> {
        self.start().await?;
        let step = self.step;
        if !self.drives() {
            let deadline = tokio::time::Instant::now() + self.step_timeout;
            let m = self
                .membership
                .as_mut()
                .ok_or_else(|| Error::Internal("a rank without a membership".into()))?;
            let stats = m.step_outcome(step, deadline).await?;
            self.step += 1;
            return Ok(stats);
        }
        let data = self
            .data
            .as_mut()
            .ok_or_else(|| Error::Config("no data source given (JobBuilder::data)".into()))?;
        let samples = data.minibatch(step)?;
        self.step_with(samples).await
    }

    /// Train one minibatch as every rank of an SPMD program calls it: rank 0 (or a single
    /// process) plans `samples`; every other rank ignores them and returns rank 0's outcome, as
    /// [`Job::step`] does there.
    pub async fn step_spmd(&mut self, samples: Vec<SampleMeta>) -> Result<StepStats> {
        self.start().await?;
        match self.drives() {
            true => self.step_with(samples).await,
            false => self.step().await,
        }
    }

    /// Every rank's `value`, in rank order, on every rank: `torch.distributed.all_gather_object`
    /// for the small objects an SPMD program shares (a rank's sampled responses, its share of an
    /// evaluation). Every rank calls it, in the same order among its other gathers; a
    /// single-process job gets `[value]` back (through the same encoding). Values are encoded
    /// with `postcard` and travel on the authenticated control plane, so all ranks' parts
    /// together must fit a control frame (32 MiB): tensors belong on the data plane.
    ///
    /// Waits at most `timeout` for the slowest rank; past it, or when a rank leaves or is lost
    /// first, every rank gets an error naming what happened (rank 0 answers the others with
    /// it). A part that does not decode is an error naming its rank.
    pub async fn all_gather<T: Serialize + DeserializeOwned>(
        &mut self,
        value: &T,
        timeout: Duration,
    ) -> Result<Vec<T>> {
        self.start().await?;
        let what = std::any::type_name::<T>();
        let bytes = postcard::to_stdvec(value)
            .map_err(|e| Error::Config(format!("all-gather: cannot encode a {what}: {e}")))?;
        let parts = match self.membership.as_mut() {
            Some(m) => {
                m.all_gather(bytes, tokio::time::Instant::now() + timeout)
                    .await?
            }
            None => vec![bytes],
        };
        parts
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                postcard::from_bytes(bytes).map_err(|e| {
                    Error::Config(format!(
                        "all-gather: rank {rank}'s part ({} bytes) is not a {what}: {e} (every \
                         rank must gather the same type in the same order)",
                        bytes.len()
                    ))
                })
            })
            .collect()
    }

    /// Wait until every rank has called `barrier` (`torch.distributed.barrier`): an all-gather
    /// of nothing, with its deadline and errors. E.g. every rank has stored the samples rank 0 is
    /// about to step on, which any rank's trainer may be given.
    pub async fn barrier(&mut self, timeout: Duration) -> Result<()> {
        self.all_gather(&(), timeout).await.map(drop)
    }

    /// Train `steps` minibatches from the data source; per-step stats.
    pub async fn run(&mut self, steps: u64) -> Result<Vec<StepStats>> {
        let mut out = Vec::new();
        for _ in 0..steps {
            out.push(self.step().await?);
        }
        Ok(out)
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Stop every actor and wait for them. In a multi-process job rank 0 first waits (at most
    /// the join timeout) until every other rank has called `shutdown` or is gone, so no rank
    /// loses a shard another still reads; other ranks tell rank 0 and wait for its word.
    pub async fn shutdown(mut self) {
        // A checkpoint still being written finishes first; its failure is reported, not lost.
        match self.wait_checkpoint().await {
            Ok(Some(dir)) => tracing::info!("checkpoint {} written at shutdown", dir.display()),
            Ok(None) => {}
            Err(e) => tracing::error!("the last checkpoint was not written: {e}"),
        }
        let deadline = tokio::time::Instant::now() + self.join_timeout;
        if self.setup.is_some() && self.membership.is_none() {
            // A rank that never started still has to join for the others to finish.
            let multi = self.setup.as_ref().is_some_and(|s| s.multi.is_some());
            if !multi || self.start().await.is_err() {
                return;
            }
        }
        let membership = self.membership.take();
        if let Some(mut m) = membership {
            if m.rank != 0 {
                m.leave(deadline).await;
                return;
            }
            m.wait_for_ranks(deadline).await;
            self.stop_supervisor().await;
            m.end(None).await;
            return;
        }
        self.stop_supervisor().await;
    }

    async fn stop_supervisor(&mut self) {
        if let Some((actor, handle)) = self.supervisor.take() {
            actor.stop(None);
            let _ = handle.await;
        }
    }
}

impl Drop for Job {
    /// A job dropped without [`Job::shutdown`] still stops its actors (without waiting for them).
    fn drop(&mut self) {
        if let Some((actor, _)) = self.supervisor.take() {
            actor.stop(None);
        }
    }
}

/// The answer of a call to the supervisor; a timeout is `Error::Step(StepError::Deadline)` for
/// `what` of `step`.
fn unwrap_call<T>(
    reply: std::result::Result<CallResult<T>, ractor::MessagingErr<SupervisorMsg>>,
    what: &str,
    step: u64,
    timeout: Duration,
) -> Result<T> {
    match reply {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(Error::Step(StepError::Deadline {
            what: what.into(),
            step,
            trainer: None,
            micro_batch: None,
            after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        })),
        Ok(CallResult::SenderError) => Err(Error::Step(StepError::Actor {
            actor: "supervisor".into(),
            reason: format!("{what}: dropped the reply"),
        })),
        Err(e) => Err(Error::Step(StepError::Actor {
            actor: "supervisor".into(),
            reason: format!("{what}: {e}"),
        })),
    }
}
