//! What one process contributes to a job: the resources its actors share that cannot cross a
//! process boundary (the transport instance, the model's initial values, the user's compute, the
//! in-process collective group). Actors start from a serializable spec plus this node, so a per-node
//! spawner can start them from a control message (docs/design.md "Processes and hosts").

use std::sync::Arc;

use odc_transport::Transport;

use crate::datapath::CollectiveGroup;
use crate::layout::ModelLayout;
use crate::policy::clock::Clock;
use crate::trainer::SharedComputeFactory;

/// See the [module docs](self).
pub struct Node {
    /// This process's data-plane endpoint.
    pub transport: Arc<dyn Transport>,
    /// The model's units with their initial values (servers materialise their shards from it).
    pub layout: Arc<ModelLayout>,
    /// Makes the compute of every trainer this node hosts.
    pub compute: SharedComputeFactory,
    /// The collective group (collective mode only): where each trainer's inbox is and the epoch
    /// floor of aborted collectives.
    pub collective: Option<Arc<CollectiveGroup>>,
    /// The clock every time this node's actors report is read from: step and micro-batch times,
    /// timeline spans, the supervisor's `now` for its deadlines. [`SystemClock`] in a real job; a
    /// clock over tokio's (virtual) time in a simulation on a paused runtime, whose deadlines
    /// (`odc_transport::now`) already follow tokio's clock.
    ///
    /// [`SystemClock`]: crate::policy::clock::SystemClock
    pub clock: Arc<dyn Clock>,
    /// The transport trainer `rank` uses, where it differs from [`Node::transport`]: a
    /// simulation's link model gives each trainer a view that knows which device it runs on.
    /// `None` (every real job): every trainer uses [`Node::transport`].
    pub trainer_transport: Option<TrainerTransport>,
    /// The transport shard server `endpoint` flushes its relays through, where it differs from
    /// [`Node::transport`]: a simulation prices the flush from the relay's devices. `None`
    /// (every real job): [`Node::transport`].
    pub server_transport: Option<TrainerTransport>,
}

/// Makes the transport of trainer `rank` or server `endpoint` (see [`Node::trainer_transport`],
/// [`Node::server_transport`]).
pub type TrainerTransport = Arc<dyn Fn(u32) -> Arc<dyn Transport> + Send + Sync>;

impl Node {
    /// The transport trainer `rank` reads, writes and sends through.
    pub fn transport_of_trainer(&self, rank: u32) -> Arc<dyn Transport> {
        match &self.trainer_transport {
            Some(make) => make(rank),
            None => self.transport.clone(),
        }
    }

    /// The transport shard server `endpoint` flushes its relays through.
    pub fn transport_of_server(&self, endpoint: u32) -> Arc<dyn Transport> {
        match &self.server_transport {
            Some(make) => make(endpoint),
            None => self.transport.clone(),
        }
    }
}
