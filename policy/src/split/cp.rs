//! Context parallelism as collective training runs it: the baselines that odc's on-demand
//! splitting is measured against ([`ContextParallel`], [`plan_cp`]).
//!
//! Collective (FSDP-like) training runs in **lockstep rounds**: in round `r` every trainer runs its
//! `r`-th micro-batch, and the round lasts as long as its costliest one. Context parallelism (CP)
//! splits a sample's attention over a group of trainers with a K/V ring, each member holding the
//! zig-zag chunks of every split sample ([`super::zigzag`]), priced by the same [`piece_cost`] as
//! odc's gangs.
//!
//! - **Static CP** ([`ContextParallel::Static`], TransformerEngine's and Megatron's `--cp-size`):
//!   the `D` trainers form `D / c` fixed groups of `c` consecutive trainers; **every** sample is
//!   split over its group (one too short to cut, fewer than `2c` tokens, runs whole on the group's
//!   first member). Across the groups the samples are balanced as LB-Micro balances them without
//!   CP: a Karmarkar–Karp partition of the per-member costs into `groups × rounds` parts, `rounds`
//!   the fewest for which every member's tokens fit the budget, sorted by cost and dealt round by
//!   round. `Static(1)` is LB-Micro itself.
//! - **Dynamic CP** ([`ContextParallel::Dynamic`], Megatron-Core's hybrid context parallelism):
//!   each sample gets its own CP size, the smallest power of two `k` with `⌈s / k⌉ ≤ t` for a
//!   per-rank token target `t` (at most the largest power of two of trainers, `max_cp`, and two
//!   tokens a member). Groups of `k` are aligned (`j·k .. (j+1)·k`, as Megatron builds its hybrid
//!   groups). Items (whole samples and split ones), costliest first, go to the round and group
//!   that raise the step least (the round's new maximum over its old one), then to the least
//!   loaded; every member's tokens stay within the budget. `t` runs over `budget, budget/2, …`
//!   and the rounds over the fewest that fit and two more; the shortest modelled step wins, ties
//!   to the larger `t` (fewer splits) and fewer rounds.
//!
//! A trainer's micro-batch in a round (a [`CpCell`]) holds whole samples and pieces of several
//! samples; it lasts `max(fixed + compute, transfers) + exposed exchange` (an empty one its
//! transfers: a collective still needs it), and the modelled step is the sum over rounds of the
//! costliest cell.
//!
//! # Guarantees (tested, as properties)
//!
//! - Every sample is placed exactly once: whole in one cell, or as one piece on each of the `k`
//!   distinct trainers of one aligned group, all in the same round.
//! - Every cell's tokens (a piece counted at `2⌈s / 2k⌉`) are within the budget.
//! - `Static(1)`'s step equals LB-Micro's ([`crate::balancer::plan_equal_count`]) on the same
//!   prices.
//! - Deterministic; bad inputs (a group size that does not divide the trainers, a sample whose
//!   pieces cannot fit the budget, a cost that is not finite) are errors naming them.

use serde::{Deserialize, Serialize};

use super::cost::{piece_cost, transfer_s, PieceCost, SplitCosts};
use super::plan::checked;
use super::SplitError;
use crate::balancer::partition;

/// How the collective baseline splits samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ContextParallel {
    /// No context parallelism (LB-Micro over whole samples; the default).
    #[default]
    Off,
    /// Fixed groups of this many trainers; every sample split over its group.
    Static(u32),
    /// A CP size per sample (Megatron-Core's hybrid CP).
    Dynamic,
}

impl ContextParallel {
    /// The short name in reports: `fsdp`, `cp2`, `cp4`, …, `dcp`.
    pub fn name(self) -> String {
        match self {
            ContextParallel::Off => "fsdp".into(),
            ContextParallel::Static(c) => format!("cp{c}"),
            ContextParallel::Dynamic => "dcp".into(),
        }
    }
}

impl std::fmt::Display for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl std::str::FromStr for ContextParallel {
    type Err = String;

    /// `off` (or `fsdp`), `dynamic` (or `dcp`), or a static group size: `N`, `cpN`.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        match t {
            "off" | "fsdp" | "none" => return Ok(ContextParallel::Off),
            "dynamic" | "dcp" => return Ok(ContextParallel::Dynamic),
            _ => {}
        }
        match t.strip_prefix("cp").unwrap_or(t).parse::<u32>() {
            Ok(1) => Ok(ContextParallel::Off),
            Ok(c) if c >= 2 => Ok(ContextParallel::Static(c)),
            _ => Err(format!(
                "context parallelism is `off`, `dynamic` or a group size of at least 2 (`4`, \
                 `cp4`), not `{s}`"
            )),
        }
    }
}

/// One sample split over a CP group.
#[derive(Debug, Clone, PartialEq)]
pub struct CpGang {
    /// Index of the sample in the planned lengths.
    pub sample: usize,
    pub tokens: u64,
    pub cost: PieceCost,
    /// The trainers of members `0..k`, ascending (an aligned group).
    pub devices: Vec<u32>,
    /// The round it runs in.
    pub round: usize,
}

/// What one trainer runs in one round.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CpCell {
    /// Whole samples (indices into the lengths), in placement order.
    pub samples: Vec<usize>,
    /// Pieces: `(gang, member)`, gangs ascending.
    pub pieces: Vec<(usize, u32)>,
    /// Tokens (a piece at `2⌈s / 2k⌉`).
    pub tokens: u64,
    /// Marginal compute of its samples and pieces.
    pub compute_s: f64,
    /// Ring exchange not hidden behind attention.
    pub exposed_s: f64,
    /// Its modelled time: `max(fixed + compute, transfers) + exposed` (transfers when empty).
    pub cost_s: f64,
}

/// A planned lockstep step with context parallelism.
#[derive(Debug, Clone, PartialEq)]
pub struct CpPlan {
    /// `rounds[r][d]`: trainer `d`'s micro-batch in round `r`.
    pub rounds: Vec<Vec<CpCell>>,
    pub gangs: Vec<CpGang>,
    /// Sum over rounds of the costliest cell.
    pub step_s: f64,
}

/// One sample as the planner places it: whole (`k = 1`) or over `k` members.
#[derive(Debug, Clone, Copy)]
struct Item {
    sample: usize,
    tokens: u64,
    k: u32,
    /// Per member.
    member_tokens: u64,
    compute_s: f64,
    exposed_s: f64,
    cost: Option<PieceCost>,
}

impl Item {
    fn weight(&self) -> f64 {
        self.compute_s + self.exposed_s
    }
}

/// Prices shared by every cell.
#[derive(Debug, Clone, Copy)]
struct Prices {
    fixed: f64,
    transfer: f64,
    budget: u64,
}

impl Prices {
    fn cell_s(&self, compute: f64, exposed: f64, empty: bool) -> f64 {
        if empty {
            self.transfer
        } else {
            (self.fixed + compute).max(self.transfer) + exposed
        }
    }
}

/// Plans one lockstep step of samples of `lengths` tokens with context parallelism `cp` (see the
/// module docs); `max_cp` bounds a dynamic group (0: the trainers). `Off` is `Static(1)`.
pub fn plan_cp<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    costs: &C,
    cp: ContextParallel,
    budget: u64,
    max_cp: u32,
) -> Result<CpPlan, SplitError> {
    let d = costs.devices();
    if d == 0 {
        return Err(SplitError::NoDevices);
    }
    if budget == 0 {
        return Err(SplitError::NoBudget);
    }
    let prices = Prices {
        fixed: checked("fixed_s", None, costs.fixed_s())?,
        transfer: transfer_s(costs),
        budget,
    };
    checked("transfer_s", None, prices.transfer)?;
    match cp {
        ContextParallel::Off => plan_static(lengths, costs, 1, prices),
        ContextParallel::Static(c) => {
            if c == 0 || d % c != 0 {
                return Err(SplitError::CpGroup {
                    size: c,
                    devices: d,
                });
            }
            plan_static(lengths, costs, c, prices)
        }
        ContextParallel::Dynamic => plan_dynamic(lengths, costs, max_cp, prices),
    }
}

/// A sample of `tokens` as an item over `k` members (whole where `k = 1` or too short to cut).
fn item<C: SplitCosts + ?Sized>(
    costs: &C,
    sample: usize,
    tokens: u64,
    k: u32,
) -> Result<Item, SplitError> {
    if k <= 1 || tokens < 2 * u64::from(k) {
        return Ok(Item {
            sample,
            tokens,
            k: 1,
            member_tokens: tokens,
            compute_s: checked("sample_s", Some(sample), costs.sample_s(tokens))?,
            exposed_s: 0.0,
            cost: None,
        });
    }
    let cost = piece_cost(costs, tokens, k);
    Ok(Item {
        sample,
        tokens,
        k,
        member_tokens: 2 * tokens.div_ceil(2 * u64::from(k)),
        compute_s: checked("sample_s", Some(sample), cost.compute_s - costs.fixed_s())?,
        exposed_s: checked("ring exchange", Some(sample), cost.comm_exposed_s)?,
        cost: Some(cost),
    })
}

/// Static CP over groups of `c` (LB-Micro's partition over the groups, see the module docs).
fn plan_static<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    costs: &C,
    c: u32,
    prices: Prices,
) -> Result<CpPlan, SplitError> {
    let d = costs.devices();
    let groups = (d / c) as usize;
    let items = lengths
        .iter()
        .enumerate()
        .map(|(i, &s)| item(costs, i, s, c))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(it) = items.iter().find(|it| it.member_tokens > prices.budget) {
        return Err(over_budget(it, prices.budget));
    }
    let weights: Vec<f64> = items.iter().map(Item::weight).collect();
    let fits =
        |part: &[usize]| part.iter().map(|&i| items[i].member_tokens).sum::<u64>() <= prices.budget;
    let member_tokens: u64 = items.iter().map(|it| it.member_tokens).sum();
    let mut rounds = (member_tokens.div_ceil(prices.budget) as usize)
        .div_ceil(groups)
        .max(1);
    let parts = loop {
        let n = (rounds * groups).min(items.len());
        let parts = partition(&weights, n, false);
        if parts.iter().all(|p| fits(p)) || n >= items.len() {
            break parts;
        }
        rounds += 1;
    };
    let mut parts: Vec<Vec<usize>> = parts.into_iter().filter(|p| !p.is_empty()).collect();
    let part_s = |p: &Vec<usize>| p.iter().map(|&i| weights[i]).sum::<f64>();
    parts.sort_by(|x, y| part_s(y).total_cmp(&part_s(x)));
    let rounds = parts.len().div_ceil(groups).max(rounds);
    let mut plan = Cells::new(rounds, d as usize, prices);
    for (n, part) in parts.iter().enumerate() {
        let (r, g) = (n / groups, n % groups);
        let group: Vec<u32> = (g as u32 * c..(g as u32 + 1) * c).collect();
        for &i in part {
            let it = &items[i];
            if it.k == 1 {
                plan.put_whole(r, group[0] as usize, it);
            } else {
                plan.put_gang(r, &group, it);
            }
        }
    }
    Ok(plan.finish())
}

/// Dynamic CP: a size per sample for each per-rank token target, placed greedily in lockstep
/// rounds; the shortest modelled step wins (see the module docs).
fn plan_dynamic<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    costs: &C,
    max_cp: u32,
    prices: Prices,
) -> Result<CpPlan, SplitError> {
    let d = costs.devices();
    let cap = if max_cp == 0 { d } else { max_cp.min(d) };
    // The largest power of two of at most `cap` trainers.
    let pow2 = |n: u32| 1u32 << (31 - n.max(1).leading_zeros());
    let kmax = pow2(cap);
    // Groups grow past a node only where the budget needs it, or in a second pass everywhere.
    let mut softs = vec![pow2(costs.devices_per_node().min(kmax)), kmax];
    softs.dedup();
    let budget = prices.budget;
    let mut best: Option<CpPlan> = None;
    for (soft, target) in softs.into_iter().flat_map(|s| {
        std::iter::successors(Some(budget), |&t| (t > 256).then_some(t / 2)).map(move |t| (s, t))
    }) {
        let mut items = Vec::with_capacity(lengths.len());
        for (i, &s) in lengths.iter().enumerate() {
            let mut k = 1u32;
            while k < kmax
                && ((k < soft && s.div_ceil(u64::from(k)) > target)
                    || 2 * s.div_ceil(2 * u64::from(k)) > budget)
            {
                k *= 2;
            }
            while k > 1 && s < 2 * u64::from(k) {
                k /= 2;
            }
            let it = item(costs, i, s, k)?;
            if it.member_tokens > budget {
                return Err(over_budget(&it, budget));
            }
            items.push(it);
        }
        items.sort_by(|x, y| {
            y.weight()
                .total_cmp(&x.weight())
                .then(x.sample.cmp(&y.sample))
        });
        let spread: u64 = items
            .iter()
            .map(|it| it.member_tokens * u64::from(it.k))
            .sum();
        let first = (spread.div_ceil(budget) as usize)
            .div_ceil(d as usize)
            .max(1);
        let mut feasible = 0;
        for rounds in first..=first + items.len() {
            let Some(plan) = place_greedy(&items, d, rounds, prices) else {
                continue;
            };
            if best.as_ref().is_none_or(|b| plan.step_s < b.step_s) {
                best = Some(plan);
            }
            feasible += 1;
            if feasible == 3 {
                break;
            }
        }
    }
    // `rounds = items.len()` always fits: one item per round, each within the budget.
    Ok(best.unwrap_or_else(|| Cells::new(1, d as usize, prices).finish()))
}

/// Places `items` (costliest first) in `rounds` lockstep rounds of `d` trainers: each at the round
/// and aligned group that raise the step least, then the least loaded; `None` when some item
/// finds no group whose members' tokens stay within the budget.
fn place_greedy(items: &[Item], d: u32, rounds: usize, prices: Prices) -> Option<CpPlan> {
    let mut plan = Cells::new(rounds, d as usize, prices);
    let mut round_max = vec![prices.transfer; rounds];
    for it in items {
        let k = it.k as usize;
        let mut best: Option<(f64, f64, usize, usize)> = None;
        for (r, top) in round_max.iter().enumerate() {
            for j in 0..d as usize / k {
                let members = j * k..(j + 1) * k;
                let cells = &plan.rounds[r][members];
                if cells
                    .iter()
                    .any(|c| c.tokens + it.member_tokens > prices.budget)
                {
                    continue;
                }
                let after = cells
                    .iter()
                    .map(|c| {
                        prices.cell_s(
                            c.compute_s + it.compute_s,
                            c.exposed_s + it.exposed_s,
                            false,
                        )
                    })
                    .fold(0.0, f64::max);
                let key = ((after - top).max(0.0), after, r, j);
                if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                    best = Some(key);
                }
            }
        }
        let (_, after, r, j) = best?;
        round_max[r] = round_max[r].max(after);
        if k == 1 {
            plan.put_whole(r, j, it);
        } else {
            let group: Vec<u32> = (j as u32 * it.k..(j as u32 + 1) * it.k).collect();
            plan.put_gang(r, &group, it);
        }
    }
    Some(plan.finish())
}

/// A plan under construction.
struct Cells {
    rounds: Vec<Vec<CpCell>>,
    gangs: Vec<CpGang>,
    prices: Prices,
}

impl Cells {
    fn new(rounds: usize, d: usize, prices: Prices) -> Self {
        Cells {
            rounds: vec![vec![CpCell::default(); d]; rounds],
            gangs: Vec::new(),
            prices,
        }
    }

    fn add(&mut self, r: usize, device: usize, it: &Item) -> &mut CpCell {
        let cell = &mut self.rounds[r][device];
        cell.tokens += it.member_tokens;
        cell.compute_s += it.compute_s;
        cell.exposed_s += it.exposed_s;
        cell
    }

    fn put_whole(&mut self, r: usize, device: usize, it: &Item) {
        self.add(r, device, it).samples.push(it.sample);
    }

    fn put_gang(&mut self, r: usize, group: &[u32], it: &Item) {
        let Some(cost) = it.cost else {
            return self.put_whole(r, group[0] as usize, it);
        };
        let id = self.gangs.len();
        for (m, &device) in group.iter().enumerate() {
            self.add(r, device as usize, it).pieces.push((id, m as u32));
        }
        self.gangs.push(CpGang {
            sample: it.sample,
            tokens: it.tokens,
            cost,
            devices: group.to_vec(),
            round: r,
        });
    }

    /// Prices every cell and the step.
    fn finish(mut self) -> CpPlan {
        let prices = self.prices;
        let mut step_s = 0.0;
        for round in &mut self.rounds {
            let mut top = 0.0f64;
            for cell in round.iter_mut() {
                let empty = cell.samples.is_empty() && cell.pieces.is_empty();
                cell.cost_s = prices.cell_s(cell.compute_s, cell.exposed_s, empty);
                top = top.max(cell.cost_s);
            }
            step_s += top;
        }
        CpPlan {
            rounds: self.rounds,
            gangs: self.gangs,
            step_s,
        }
    }
}

fn over_budget(it: &Item, budget: u64) -> SplitError {
    SplitError::PiecesOverBudget {
        sample: it.sample,
        tokens: it.tokens,
        budget,
    }
}

/// The static CP group sizes weighed for `devices` trainers with groups of at most `cap`: 2, 4,
/// …, 64, those that divide the trainers (TransformerEngine's and Megatron's sizes).
pub fn static_cp_sizes(devices: u32, cap: u32) -> impl Iterator<Item = u32> {
    [2, 4, 8, 16, 32, 64]
        .into_iter()
        .filter(move |&c| c <= cap && devices % c == 0)
}

/// The step of `plan` run on demand, without lockstep: each trainer runs its cells in round order
/// (an empty cell is no micro-batch at all); the trainers a round's gangs tie together (directly
/// or through a chain of gangs) start that round's cells when the last of them is free and, their
/// rings pacing each other layer by layer, finish together after the costliest of those cells; a
/// trainer tied to no gang runs its cell as soon as it is free. At most the lockstep step.
pub fn unlocked_step_s(plan: &CpPlan) -> f64 {
    let d = plan.rounds.first().map_or(0, Vec::len);
    let mut free = vec![0.0f64; d];
    for (r, round) in plan.rounds.iter().enumerate() {
        // Union-find over the trainers tied by this round's gangs.
        let mut parent: Vec<usize> = (0..d).collect();
        fn root(parent: &mut [usize], mut x: usize) -> usize {
            while parent[x] != x {
                parent[x] = parent[parent[x]];
                x = parent[x];
            }
            x
        }
        for gang in plan.gangs.iter().filter(|g| g.round == r) {
            for w in gang.devices.windows(2) {
                let (a, b) = (
                    root(&mut parent, w[0] as usize),
                    root(&mut parent, w[1] as usize),
                );
                parent[a] = b;
            }
        }
        let mut start = vec![0.0f64; d];
        let mut cost = vec![0.0f64; d];
        for (device, cell) in round.iter().enumerate() {
            if cell.samples.is_empty() && cell.pieces.is_empty() {
                continue;
            }
            let g = root(&mut parent, device);
            start[g] = start[g].max(free[device]);
            cost[g] = cost[g].max(cell.cost_s);
        }
        for (device, cell) in round.iter().enumerate() {
            if cell.samples.is_empty() && cell.pieces.is_empty() {
                continue;
            }
            let g = root(&mut parent, device);
            free[device] = start[g] + cost[g];
        }
    }
    free.into_iter().fold(0.0, f64::max)
}
