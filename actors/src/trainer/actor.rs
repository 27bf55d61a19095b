//! The trainer actor (see the [module docs](super)).

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::compute::Compute;
use super::context::TrainerContext;
use super::{MicroBatchDone, TrainerMsg, TrainerReport, TrainerSpec};
use crate::datapath::{Collective, DataPath, GangChannel, OnDemand};
use crate::error::Error;
use crate::node::Node;
use crate::policy::dispatch::Communication;
use crate::policy::step::StepError;
use crate::supervisor::SupervisorMsg;
use crate::NonFiniteAt;

/// How to start a trainer: its serializable spec, its process's resources and its supervisor.
pub struct TrainerArgs {
    pub spec: TrainerSpec,
    pub node: Arc<Node>,
    pub supervisor: ActorRef<SupervisorMsg>,
}

/// State of a trainer.
pub struct TrainerState {
    rank: u32,
    compute: Box<dyn Compute>,
    context: TrainerContext,
    supervisor: ActorRef<SupervisorMsg>,
}

/// The trainer actor.
pub struct Trainer;

impl Actor for Trainer {
    type Msg = TrainerMsg;
    type State = TrainerState;
    type Arguments = TrainerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: TrainerArgs,
    ) -> std::result::Result<TrainerState, ActorProcessingErr> {
        let TrainerArgs {
            spec,
            node,
            supervisor,
        } = args;
        let directory = spec.directory;
        let chunk_elems = usize::try_from(spec.context.chunk_elems).unwrap_or(usize::MAX);
        let transport = node.transport_of_trainer(spec.rank);
        // On demand, a node with a group of trainer inboxes is a job that splits samples: each
        // trainer gets its inbox for its gangs' exchange. In collective mode the gangs share the
        // collective path's inbox (their write ids are apart).
        let (path, gang): (Arc<dyn DataPath>, Option<GangChannel>) = match spec.communication {
            Communication::OnDemand => {
                let gang = match &node.collective {
                    Some(group) => Some(GangChannel::new(
                        spec.rank,
                        transport.clone(),
                        group.clone(),
                    )?),
                    None => None,
                };
                let path = OnDemand::new(transport, directory, chunk_elems);
                (Arc::new(path), gang)
            }
            Communication::Collective => {
                let group = node.collective.clone().ok_or_else(|| {
                    Error::Config("collective mode without a collective group".into())
                })?;
                let path = Collective::new(
                    spec.rank,
                    transport.clone(),
                    group.clone(),
                    directory,
                    chunk_elems,
                )?;
                let gang = GangChannel::sharing(spec.rank, transport, group, path.inbox());
                (Arc::new(path), Some(gang))
            }
        };
        let mut context = TrainerContext::new(spec.rank, node.layout.clone(), path, spec.context)
            .with_clock(node.clock.clone());
        if let Some(gang) = gang {
            context = context.with_gang(gang);
        }
        Ok(TrainerState {
            rank: spec.rank,
            compute: node.compute.create(spec.rank),
            context,
            supervisor,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: TrainerMsg,
        state: &mut TrainerState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let TrainerMsg::Run(assignment) = msg;
        let started = state.context.now();
        let mb = &assignment.micro_batch;
        state
            .context
            .begin(mb, assignment.epoch, assignment.token, assignment.step);
        let output = state.compute.run(&mut state.context, mb).await;
        let finished_io = state.context.finish().await;
        let result = match (output, finished_io) {
            // A refused non-finite gradient decides, whatever the compute made of it.
            (_, Err(e @ Error::Step(StepError::NonFinite(_)))) => Err(e),
            (Ok(output), Ok(_)) if !output.loss_sum.is_finite() => {
                Err(Error::Step(StepError::NonFinite(Box::new(NonFiniteAt {
                    what: "loss".into(),
                    step: mb.step,
                    trainer: Some(state.rank),
                    micro_batch: Some(mb.id),
                    samples: mb.samples.iter().map(|s| s.index).collect(),
                    unit: None,
                    element: None,
                    value: output.loss_sum.to_string(),
                }))))
            }
            (Ok(output), Ok(stats)) => Ok(MicroBatchDone { output, stats }),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        let report = TrainerReport {
            trainer: state.rank,
            epoch: assignment.epoch,
            micro_batch: mb.id,
            token: assignment.token,
            started,
            finished: state.context.now(),
            result,
        };
        state.supervisor.cast(SupervisorMsg::Done(report))?;
        Ok(())
    }
}
