//! What one process contributes to a job: the resources its actors share that cannot cross a
//! process boundary (the transport instance, the model's initial values, the user's compute, the
//! in-process collective group). Actors start from a serializable spec plus this node, so a per-node
//! spawner can start them from a control message (DESIGN "Processes and hosts").

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
}
