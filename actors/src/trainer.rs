//! The trainer actor: runs user compute on one micro-batch at a time and reports to the supervisor.
//!
//! A micro-batch is reported done only after every gradient push was acknowledged by its owners
//! (DESIGN step 4). A panic in user compute fails the actor; being spawned linked, the failure
//! reaches the supervisor as a supervision event (I2 replay). Trainers never talk to each other
//! (I4): the only thing a trainer waits on is its own transfers.

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::compute::{Compute, ComputeOutput, MicroBatch};
use crate::context::{MicroBatchStats, TrainerContext};
use crate::error::Result;
use crate::policy::clock::{Clock, SystemClock, Timestamp};
use crate::supervisor::SupervisorMsg;

/// One micro-batch to run within the accumulator epoch `epoch`.
#[derive(Debug, Clone)]
pub struct Assignment {
    pub micro_batch: MicroBatch,
    pub epoch: u64,
}

/// Messages of a trainer.
pub enum TrainerMsg {
    Run(Assignment),
}

/// What a trainer tells the supervisor after a micro-batch.
#[derive(Debug)]
pub struct TrainerReport {
    pub trainer: usize,
    pub epoch: u64,
    pub micro_batch: usize,
    pub started: Timestamp,
    pub finished: Timestamp,
    pub result: Result<(ComputeOutput, MicroBatchStats)>,
}

/// How to build a trainer.
pub struct TrainerArgs {
    pub index: usize,
    pub compute: Box<dyn Compute>,
    pub context: TrainerContext,
    pub supervisor: ActorRef<SupervisorMsg>,
}

/// State of a trainer.
pub struct TrainerState {
    index: usize,
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
        Ok(TrainerState {
            index: args.index,
            compute: args.compute,
            context: args.context,
            supervisor: args.supervisor,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: TrainerMsg,
        state: &mut TrainerState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let TrainerMsg::Run(assignment) = msg;
        let started = SystemClock.now();
        let mb = &assignment.micro_batch;
        state.context.begin(mb, assignment.epoch);
        let output = state.compute.run(&mut state.context, mb).await;
        let finished_io = state.context.finish().await;
        let result = match (output, finished_io) {
            (Ok(out), Ok(stats)) => Ok((out, stats)),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        let report = TrainerReport {
            trainer: state.index,
            epoch: assignment.epoch,
            micro_batch: mb.id,
            started,
            finished: SystemClock.now(),
            result,
        };
        state.supervisor.cast(SupervisorMsg::Done(report))?;
        Ok(())
    }
}
