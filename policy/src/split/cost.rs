//! What a split costs: the interface the splitting planner prices its choices with
//! ([`SplitCosts`]), and the context-parallel cost of one sample over a gang ([`piece_cost`]),
//! computed from it in this one place.
//!
//! Two implementations price the same planner: the runtime's (from the job's cost model and its
//! transport) and `odc-bench sim`'s modelled cluster (a calibrated device profile and a topology).
//!
//! # The cost of one sample over a gang of `k` (ring attention)
//!
//! - The sample is cut into `2k` chunks, chunks `i` and `2k − 1 − i` on member `i`
//!   ([`super::zigzag`]): each member holds `s/k` tokens and `1/k` of the causal attention. Compute
//!   per member: `max(sample(s)/k, sample(⌈s/k⌉)) + fixed` — the `k`-th of the sample, but never
//!   cheaper than a sample of the chunk's length (short pieces lose kernel efficiency as short
//!   samples do).
//! - **Ring exchange.** Per attention layer the forward passes K/V blocks around the gang in
//!   `k − 1` steps, each sending `⌈s/k⌉ · kv_bytes_per_token` to the next member over one hop
//!   ([`SplitCosts::ring_link`]: inside a node, or across nodes as soon as the gang spans nodes),
//!   each overlapped with the attention of the block in hand, `attention(s) / (3k²)` (the layer's
//!   forward attention is a third of its forward and backward). The backward moves K/V and dK/dV,
//!   twice the bytes against twice the compute. Each step also costs its member compute-stream
//!   time the hop cannot hide ([`SplitCosts::ring_step_overhead_s`]: the block kernels' launches
//!   and the merge of each block's partial result — the log-sum-exp merge of the output forward,
//!   the dQ, dK and dV accumulation backward). Exposed per layer:
//!   `3(k − 1) · max(0, hop − attention(s) / (3k²)) + (k − 1) · overhead(⌈s/k⌉)`.
//! - **Peer wait.** With every cost known the zig-zag members are even and never wait for each
//!   other; the wait for a late member is a cost the planner cannot see, paid where the run's
//!   noise is modelled (`odc-bench`'s `sim::noise`: a gang's members wait for each other layer by
//!   layer).
//! - **Transfers.** Every member pulls the parameters of every layer it computes (each member
//!   computes every layer on its chunks) and pushes its gradient share: a piece occupies its
//!   member for `max(compute, pulls, pushes) + exposed exchange`, like any micro-batch
//!   ([`micro_batch_s`]).
//!
//! Guarantee: for finite, non-negative inputs every cost is finite and non-negative, and a piece
//! is never cheaper than its pulls or its pushes.

/// One direction of a link: what one message of `bytes` costs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Link {
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Seconds from the last byte sent to the message delivered.
    pub latency_s: f64,
}

impl Link {
    /// Seconds of one message of `bytes` on an idle link.
    pub fn message_s(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.bytes_per_s
    }
}

/// The costs the splitting planner needs, in seconds (any one unit will do).
pub trait SplitCosts {
    /// Trainers of the step (devices).
    fn devices(&self) -> u32;
    /// Trainers per node: a gang of at most this many sits in one node.
    fn devices_per_node(&self) -> u32;
    /// Compute of one micro-batch besides its samples'.
    fn fixed_s(&self) -> f64;
    /// Marginal compute of one whole sample of `tokens`.
    fn sample_s(&self, tokens: u64) -> f64;
    /// Of [`SplitCosts::sample_s`], one attention layer's attention (forward and backward) for a
    /// whole sample of `tokens`: what a ring step hides behind.
    fn layer_attention_s(&self, tokens: u64) -> f64;
    /// Attention layers, each exchanging K/V in a gang.
    fn attention_layers(&self) -> u32;
    /// Bytes of one token's keys and values in one layer (what a ring step sends per token).
    fn kv_bytes_per_token(&self) -> u64;
    /// One ring hop, inside a node or across nodes.
    fn ring_link(&self, inter_node: bool) -> Link;
    /// Compute-stream seconds of one ring step of one layer, forward and backward together, for
    /// a member holding `chunk_tokens`, that the hop does not hide: the block kernels' launches
    /// and the merge of the block's partial result (see the module docs). Zero where not priced.
    fn ring_step_overhead_s(&self, chunk_tokens: u64) -> f64 {
        let _ = chunk_tokens;
        0.0
    }
    /// Seconds one micro-batch's parameter pulls occupy a trainer's ingress (overlapped with its
    /// compute by prefetching).
    fn pull_s(&self) -> f64;
    /// Seconds one micro-batch's gradient pushes occupy a trainer's egress (overlapped with its
    /// backward). Zero where pushes are not priced.
    fn push_s(&self) -> f64 {
        0.0
    }
    /// Whether the ring exchange has a price here (even a zero one): where it has none, splitting
    /// every sample would look free ([`super::plan_on_demand`] then plans gangs only).
    fn prices_ring(&self) -> bool {
        true
    }
}

/// Seconds the transfers of one micro-batch occupy a trainer: its pulls and its pushes run on the
/// two directions of its ports, in parallel with each other and with compute.
pub fn transfer_s<C: SplitCosts + ?Sized>(costs: &C) -> f64 {
    costs.pull_s().max(costs.push_s())
}

/// Seconds a micro-batch of `compute_s` seconds of compute occupies its trainer:
/// `max(compute, transfers)`.
pub fn micro_batch_s<C: SplitCosts + ?Sized>(costs: &C, compute_s: f64) -> f64 {
    compute_s.max(transfer_s(costs))
}

/// Per-member cost of one sample split over a gang of `k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PieceCost {
    /// Members of the gang.
    pub k: u32,
    /// Whether the gang spans nodes (its ring crosses the NIC).
    pub inter_node: bool,
    /// Compute per member, the micro-batch's fixed cost included.
    pub compute_s: f64,
    /// Transfers per member ([`transfer_s`]).
    pub transfer_s: f64,
    /// Ring exchange not hidden behind attention, and the ring steps' own launches and merges.
    pub comm_exposed_s: f64,
}

impl PieceCost {
    /// Seconds each member is busy: `max(compute, transfers) + exposed exchange`.
    pub fn piece_s(&self) -> f64 {
        self.compute_s.max(self.transfer_s) + self.comm_exposed_s
    }
}

/// The cost of a sample of `tokens` over a gang of `k ≥ 2` (see the module docs), the gang
/// spanning nodes where it is larger than one.
pub fn piece_cost<C: SplitCosts + ?Sized>(costs: &C, tokens: u64, k: u32) -> PieceCost {
    piece_cost_on(costs, tokens, k, k > costs.devices_per_node())
}

/// [`piece_cost`] of a gang whose placement is known: `inter_node` where its members sit on more
/// than one node (what a run pays; the planner prices a gang by its size).
pub fn piece_cost_on<C: SplitCosts + ?Sized>(
    costs: &C,
    tokens: u64,
    k: u32,
    inter_node: bool,
) -> PieceCost {
    let k = k.max(1);
    let kf = f64::from(k);
    let chunk = tokens.div_ceil(u64::from(k));
    let compute_s = (costs.sample_s(tokens) / kf).max(costs.sample_s(chunk)) + costs.fixed_s();
    let link = costs.ring_link(inter_node);
    let hop = link.message_s(chunk.saturating_mul(costs.kv_bytes_per_token()));
    let hidden = costs.layer_attention_s(tokens) / (3.0 * kf * kf);
    let overhead = costs.ring_step_overhead_s(chunk);
    let per_layer = (kf - 1.0) * (3.0 * (hop - hidden).max(0.0) + overhead);
    PieceCost {
        k,
        inter_node,
        compute_s,
        transfer_s: transfer_s(costs),
        comm_exposed_s: f64::from(costs.attention_layers()) * per_layer,
    }
}
