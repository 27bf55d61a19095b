//! The user's switch ([`SplitPolicy`]) and the runtime's prices for the planner
//! ([`CostModelCosts`]).

use serde::{Deserialize, Serialize};

use super::cost::{Link, SplitCosts};
use crate::balancer::CostModel;

/// Whether a job splits long samples over gangs of trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SplitPolicy {
    /// Never (the default).
    #[default]
    Off,
    /// Where the planner finds that it shortens the step ([`super::plan`]).
    Auto,
    /// As `Auto`, for samples of at least this many tokens only.
    MinTokens(u64),
}

impl SplitPolicy {
    /// The smallest sample that may be split, `None` when off.
    pub fn min_tokens(self) -> Option<u64> {
        match self {
            SplitPolicy::Off => None,
            SplitPolicy::Auto => Some(0),
            SplitPolicy::MinTokens(n) => Some(n),
        }
    }
}

impl std::str::FromStr for SplitPolicy {
    type Err = String;

    /// `off`, `auto`, or a number of tokens (`MinTokens`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "off" | "false" => Ok(SplitPolicy::Off),
            "auto" | "true" => Ok(SplitPolicy::Auto),
            n => n.parse::<u64>().map(SplitPolicy::MinTokens).map_err(|_| {
                format!("a split policy is `off`, `auto` or a number of tokens, not `{s}`")
            }),
        }
    }
}

/// The price of a gang's K/V ring in a job: what each attention layer's exchange sends per token,
/// over which links, and what each ring step costs beside them, in the job's cost units (seconds
/// where its cost model is in seconds). A job that sets none prices no ring (its on-demand steps then plan gangs
/// only, [`super::plan_on_demand`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RingPrice {
    /// Attention layers, each exchanging K/V in a gang.
    pub layers: u32,
    /// Bytes of one token's keys and values in one layer.
    pub kv_bytes_per_token: u64,
    /// One ring hop inside a node, and across nodes.
    pub intra: Link,
    pub inter: Link,
    /// Trainers per node: a gang of at most this many pays `intra`, a larger one `inter` (0:
    /// every gang counts as within one node).
    #[serde(default)]
    pub node_size: u32,
    /// What one ring step of one layer costs its member on the compute stream beside the hop,
    /// forward and backward together ([`SplitCosts::ring_step_overhead_s`]): `step_s` for the
    /// block kernels' launches, `step_per_token_s` per token of the member's chunk for the merges
    /// of the block's partial result.
    #[serde(default)]
    pub step_s: f64,
    #[serde(default)]
    pub step_per_token_s: f64,
}

impl RingPrice {
    /// A ring that costs nothing (an emulated device that does not emulate the exchange).
    pub fn free() -> Self {
        let link = Link {
            bytes_per_s: f64::INFINITY,
            latency_s: 0.0,
        };
        RingPrice {
            layers: 1,
            kv_bytes_per_token: 0,
            intra: link,
            inter: link,
            node_size: 0,
            step_s: 0.0,
            step_per_token_s: 0.0,
        }
    }

    /// Compute-stream seconds of one ring step of one layer for a member holding `chunk_tokens`.
    pub fn step_overhead_s(&self, chunk_tokens: u64) -> f64 {
        self.step_s + chunk_tokens as f64 * self.step_per_token_s
    }
}

/// The runtime's prices: the job's cost model for compute (its quadratic part is attention) and
/// for a micro-batch's transfers ([`CostModel::transfer`], pulls and pushes together: a piece, like
/// any micro-batch, lasts at least that long); gangs of up to `per_node` trainers count as within
/// one node; the ring, its steps' launches and merges as the job's [`RingPrice`] says (none: not
/// priced). A per-micro-batch fixed compute is not priced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModelCosts {
    pub cost: CostModel,
    pub devices: u32,
    pub per_node: u32,
    pub ring: Option<RingPrice>,
}

impl SplitCosts for CostModelCosts {
    fn devices(&self) -> u32 {
        self.devices
    }
    fn devices_per_node(&self) -> u32 {
        self.per_node
    }
    fn fixed_s(&self) -> f64 {
        0.0
    }
    fn sample_s(&self, tokens: u64) -> f64 {
        self.cost.cost(tokens)
    }
    fn layer_attention_s(&self, tokens: u64) -> f64 {
        let s = tokens as f64 / self.cost.scale;
        self.cost.a * s * s / f64::from(self.attention_layers())
    }
    fn attention_layers(&self) -> u32 {
        self.ring.map_or(1, |r| r.layers.max(1))
    }
    fn kv_bytes_per_token(&self) -> u64 {
        self.ring.map_or(0, |r| r.kv_bytes_per_token)
    }
    fn ring_link(&self, inter_node: bool) -> Link {
        match self.ring {
            Some(r) if inter_node => r.inter,
            Some(r) => r.intra,
            None => RingPrice::free().intra,
        }
    }
    fn ring_step_overhead_s(&self, chunk_tokens: u64) -> f64 {
        self.ring.map_or(0.0, |r| r.step_overhead_s(chunk_tokens))
    }
    fn pull_s(&self) -> f64 {
        self.cost.transfer
    }
    fn prices_ring(&self) -> bool {
        self.ring.is_some()
    }
}
