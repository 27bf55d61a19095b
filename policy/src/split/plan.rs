//! The splitting planner: which samples of a step run split over a gang, over how many members and
//! on which trainers, and where every other sample goes — priced by one [`SplitCosts`].
//!
//! # Policy
//!
//! 1. **Costs.** A whole sample of `s` tokens costs `w(s) = fixed + sample(s)` (a micro-batch of its
//!    own). The **balanced step** (the target) is the perfect-balance bound
//!    `(Σ sample(sᵢ) + fixed · fewest) / D`: every sample's marginal cost plus the fewest
//!    micro-batches' fixed costs, spread evenly (`fewest`: one per sample over the budget, and
//!    `⌈Σ sᵢ / budget⌉` for the others).
//! 2. **Split.** A sample with `w(s)` above the target (and at least [`SplitOptions::min_tokens`]
//!    tokens) is considered for gangs of `k ∈ {2, …, G}` (one node of `G` trainers), then
//!    `{2G, 3G, …}` (whole nodes), up to `D`, at most [`SplitOptions::max_gang`] and at most
//!    `s / 2` (two tokens a member, [`super::zigzag`]). The smallest `k` whose piece ([`piece_cost`]) fits the target is taken;
//!    if none fits, the `k` with the cheapest piece. If that piece is not cheaper than the whole
//!    sample's micro-batch ([`micro_batch_s`]: the transfers or the exchange eat the gain), the
//!    sample stays whole.
//! 3. **Place.** Gangs first, costliest first: a gang takes `k` trainers at once — inside one node
//!    the `k` least-loaded trainers of the node where they are free earliest, across nodes the
//!    `k / G` whole nodes free earliest — and starts when the last of them is free. Then whole
//!    samples, costliest first, each onto the least-loaded trainer (LPT, ties by index); each
//!    trainer's share packed as static plans pack ([`pack_even`]: the fewest micro-batches of at
//!    most `budget` tokens, of even cost; a sample over the budget alone), each lasting
//!    `max(fixed + compute, transfers)`.
//! 4. **Step** = the latest trainer's finish. Splitting the costliest `j` of the samples worth
//!    splitting is tried for `j ∈ {0, 1, 2, 4, …, all}` and the shortest step kept, ties to fewer
//!    splits: with about one sample per trainer, gangs crowd each other and splitting all of them
//!    can lose to splitting a few. The whole search runs again with the pieces' target doubled
//!    (2×, 4×, … the balanced step, while a whole sample costs more): where one sample dwarfs the
//!    rest, a smaller gang for it that leaves trainers to the others beats the widest gang.
//!
//! # Guarantees (tested, as properties)
//!
//! - Every sample is placed exactly once: whole in one micro-batch of one trainer, or as one piece
//!   on each of `k` distinct trainers of its gang.
//! - Splitting never lengthens the modelled step: `j = 0` is the unsplit plan and a plan with
//!   gangs is kept only when strictly shorter. With splitting off, or nothing above the target,
//!   the plan is the unsplit plan.
//! - Deterministic (ties by index); `step ≥ perfect` for the unsplit plan.
//! - Bad inputs (no trainer, no budget, a cost that is not a finite non-negative number) are
//!   errors naming what was wrong.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::cost::{micro_batch_s, piece_cost, transfer_s, PieceCost, SplitCosts};
use super::SplitError;
use crate::balancer::pack_even;

/// ODC's default micro-batch token budget.
pub const DEFAULT_TOKEN_BUDGET: u64 = 65_536;

/// Planning options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitOptions {
    /// Tokens per micro-batch of whole samples.
    pub token_budget: u64,
    /// Whether long samples may be split.
    pub split: bool,
    /// Samples shorter than this are never split.
    pub min_tokens: u64,
    /// The most members a gang may have (0: no limit).
    pub max_gang: u32,
    /// A sample over `token_budget` must be split into pieces of at most the budget each (the
    /// runtime: the budget bounds a micro-batch's memory). Otherwise it runs whole, alone.
    pub pieces_within_budget: bool,
}

impl Default for SplitOptions {
    fn default() -> Self {
        SplitOptions {
            token_budget: DEFAULT_TOKEN_BUDGET,
            split: true,
            min_tokens: 0,
            max_gang: 0,
            pieces_within_budget: false,
        }
    }
}

/// One sample split over a gang.
#[derive(Debug, Clone, PartialEq)]
pub struct Gang {
    /// Index of the sample in the planned lengths.
    pub sample: usize,
    pub tokens: u64,
    pub cost: PieceCost,
    /// The trainers of members `0..k`, ascending.
    pub devices: Vec<u32>,
    /// When the gang starts: the last of its trainers is free.
    pub start_s: f64,
}

/// What one trainer runs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceAssignment {
    /// Indices into [`SplitPlan::gangs`] of the pieces it runs, in order.
    pub pieces: Vec<usize>,
    /// Whole samples (indices into the lengths) per micro-batch, in order.
    pub micro_batches: Vec<Vec<usize>>,
    /// When it finishes (idle time before a gang's start included).
    pub finish_s: f64,
}

/// A planned step.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPlan {
    pub devices: Vec<DeviceAssignment>,
    pub gangs: Vec<Gang>,
    /// Modelled step: the latest trainer's finish.
    pub step_s: f64,
    /// Perfect balance: total compute / D (the target).
    pub perfect_s: f64,
    /// Best possible without splitting: `max(perfect, costliest whole sample's micro-batch)`.
    pub achievable_unsplit_s: f64,
}

/// Candidate gang sizes for `d` trainers in nodes of `g`: `2..=g`, then whole nodes.
pub fn gang_sizes(d: u32, g: u32) -> impl Iterator<Item = u32> {
    let g = g.max(1);
    (2..=g.min(d)).chain((2..=d / g).map(move |n| n * g))
}

/// Checks that a cost is a finite, non-negative number.
pub(super) fn checked(
    what: &'static str,
    at: Option<usize>,
    value: f64,
) -> Result<f64, SplitError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(SplitError::BadCost { what, at, value })
    }
}

/// Whether a gang of `k` cuts `tokens` into pieces of at most `budget` tokens: zig-zag gives each
/// member two chunks of at most `⌈tokens / 2k⌉`.
fn pieces_fit(tokens: u64, k: u32, budget: u64) -> bool {
    2 * tokens.div_ceil(2 * u64::from(k)) <= budget
}

/// The gang for one sample whose whole micro-batch costs `whole_s`; `None`: keep it whole. With
/// `within` (a budget the pieces must fit), only gangs whose pieces fit it, and a gang even where
/// it is not cheaper than the whole sample.
fn choose<C: SplitCosts + ?Sized>(
    costs: &C,
    tokens: u64,
    whole_s: f64,
    target_s: f64,
    max_gang: u32,
    within: Option<u64>,
) -> Option<PieceCost> {
    let mut best: Option<PieceCost> = None;
    for k in gang_sizes(costs.devices(), costs.devices_per_node()) {
        if tokens < 2 * u64::from(k) || (max_gang > 0 && k > max_gang) {
            break;
        }
        if within.is_some_and(|budget| !pieces_fit(tokens, k, budget)) {
            continue;
        }
        let c = piece_cost(costs, tokens, k);
        if !c.piece_s().is_finite() {
            continue;
        }
        if c.piece_s() <= target_s {
            best = Some(c);
            break;
        }
        if best.is_none_or(|b| c.piece_s() < b.piece_s()) {
            best = Some(c);
        }
    }
    best.filter(|b| within.is_some() || b.piece_s() < whole_s)
}

/// Plans one step of samples of `lengths` tokens (see the module docs).
pub fn plan<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    costs: &C,
    options: SplitOptions,
) -> Result<SplitPlan, SplitError> {
    let d = costs.devices();
    if d == 0 {
        return Err(SplitError::NoDevices);
    }
    if costs.devices_per_node() == 0 {
        return Err(SplitError::NoDevicesPerNode);
    }
    if options.token_budget == 0 {
        return Err(SplitError::NoBudget);
    }
    let fixed = checked("fixed_s", None, costs.fixed_s())?;
    checked("pull_s", None, costs.pull_s())?;
    checked("push_s", None, costs.push_s())?;
    let transfer = transfer_s(costs);
    let marginal = lengths
        .iter()
        .enumerate()
        .map(|(i, &s)| checked("sample_s", Some(i), costs.sample_s(s)))
        .collect::<Result<Vec<f64>, _>>()?;
    // The fewest micro-batches: a sample over the budget is one of its own, the rest fill
    // micro-batches of at most the budget.
    let (over, under): (Vec<u64>, Vec<u64>) =
        lengths.iter().partition(|&&s| s > options.token_budget);
    let fewest = over.len() as u64 + under.iter().sum::<u64>().div_ceil(options.token_budget);
    let perfect_s = (marginal.iter().sum::<f64>() + fixed * fewest as f64) / f64::from(d);
    let whole = |i: usize| fixed + marginal[i];
    let whole_mb = |i: usize| micro_batch_s(costs, whole(i));
    let achievable_unsplit_s = (0..lengths.len()).map(whole_mb).fold(perfect_s, f64::max);

    // Costliest first, ties by index.
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&x, &y| marginal[y].total_cmp(&marginal[x]).then(x.cmp(&y)));

    // The samples that must be split (over the budget, with `pieces_within_budget`), then those
    // worth splitting, costliest first, with their gang.
    let must = |i: usize| {
        options.split && options.pieces_within_budget && lengths[i] > options.token_budget
    };
    let mut candidates: Vec<(usize, PieceCost)> = Vec::new();
    for &i in order.iter().filter(|&&i| must(i)) {
        let within = Some(options.token_budget);
        match choose(
            costs,
            lengths[i],
            whole_mb(i),
            perfect_s,
            options.max_gang,
            within,
        ) {
            Some(c) => candidates.push((i, c)),
            None => {
                return Err(SplitError::PiecesOverBudget {
                    sample: i,
                    tokens: lengths[i],
                    budget: options.token_budget,
                })
            }
        }
    }
    let mandatory = candidates.len();
    let costliest = (0..lengths.len()).map(whole).fold(0.0f64, f64::max);
    // The samples worth splitting, costliest first, each with its gang for a piece target.
    let worth = |target: f64| -> Vec<(usize, PieceCost)> {
        order
            .iter()
            .filter(|&&i| {
                options.split
                    && !must(i)
                    && lengths[i] >= options.min_tokens
                    && whole(i) > perfect_s
            })
            .filter_map(|&i| {
                let c = choose(
                    costs,
                    lengths[i],
                    whole_mb(i),
                    target,
                    options.max_gang,
                    None,
                );
                c.map(|c| (i, c))
            })
            .collect()
    };
    let packing = Packing {
        fixed,
        transfer,
        budget: options.token_budget,
    };
    let placed = |splits: &[(usize, PieceCost)]| {
        let (devices, gangs) = place(
            lengths,
            &order,
            splits,
            &marginal,
            packing,
            d,
            costs.devices_per_node(),
        );
        let step = devices.iter().map(|a| a.finish_s).fold(0.0f64, f64::max);
        (step, devices, gangs)
    };
    // Only what must be split, then the costliest 1, 2, 4, … of those worth it for each target:
    // the balanced step, then twice it, four times, … while a whole sample is above it (a smaller
    // gang for the longest samples leaves trainers to the rest).
    let mut best = placed(&candidates);
    let mut target = perfect_s;
    loop {
        let optional = worth(target);
        candidates.truncate(mandatory);
        candidates.extend_from_slice(&optional);
        let mut j = mandatory;
        while j < candidates.len() {
            j = (mandatory + 2 * (j - mandatory)).clamp(mandatory + 1, candidates.len());
            let tried = placed(&candidates[..j]);
            if tried.0 < best.0 {
                best = tried;
            }
        }
        target *= 2.0;
        // At most log2(D) + 1 rounds: no whole sample costs more than D × the balanced step.
        if target >= costliest || optional.is_empty() {
            break;
        }
    }
    let (step_s, devices, gangs) = best;
    Ok(SplitPlan {
        devices,
        gangs,
        step_s,
        perfect_s,
        achievable_unsplit_s,
    })
}

/// How micro-batches of whole samples are packed and priced.
#[derive(Debug, Clone, Copy)]
struct Packing {
    /// Fixed compute per micro-batch.
    fixed: f64,
    /// Transfers per micro-batch, overlapped with its compute.
    transfer: f64,
    budget: u64,
}

/// Places `splits` as gangs, then every other sample of `order` whole (see the module docs).
fn place(
    lengths: &[u64],
    order: &[usize],
    splits: &[(usize, PieceCost)],
    marginal: &[f64],
    packing: Packing,
    d: u32,
    g: u32,
) -> (Vec<DeviceAssignment>, Vec<Gang>) {
    let nodes = d.div_ceil(g);
    let mut is_split = vec![false; lengths.len()];
    let mut gangs: Vec<Gang> = splits
        .iter()
        .map(|&(i, cost)| {
            is_split[i] = true;
            Gang {
                sample: i,
                tokens: lengths[i],
                cost,
                devices: Vec::new(),
                start_s: 0.0,
            }
        })
        .collect();
    gangs.sort_by(|x, y| {
        y.cost
            .piece_s()
            .total_cmp(&x.cost.piece_s())
            .then(x.sample.cmp(&y.sample))
    });

    let mut devices = vec![DeviceAssignment::default(); d as usize];
    let node_devices = |node: u32| (node * g)..((node + 1) * g).min(d);
    for (gi, gang) in gangs.iter_mut().enumerate() {
        let k = gang.cost.k;
        let mut chosen: Vec<u32> = if k <= g {
            // The node where its k least-loaded trainers are free earliest.
            let mut best: Option<(f64, Vec<u32>)> = None;
            for node in 0..nodes {
                let mut ds: Vec<u32> = node_devices(node).collect();
                if ds.len() < k as usize {
                    continue;
                }
                ds.sort_by(|&x, &y| {
                    devices[x as usize]
                        .finish_s
                        .total_cmp(&devices[y as usize].finish_s)
                        .then(x.cmp(&y))
                });
                ds.truncate(k as usize);
                let start = devices[ds[k as usize - 1] as usize].finish_s;
                if best.as_ref().is_none_or(|b| start < b.0) {
                    best = Some((start, ds));
                }
            }
            best.map(|b| b.1).unwrap_or_default()
        } else {
            // The k / G whole nodes free earliest.
            let free = |node: u32| {
                node_devices(node)
                    .map(|x| devices[x as usize].finish_s)
                    .fold(0.0f64, f64::max)
            };
            let mut whole_nodes: Vec<u32> = (0..nodes)
                .filter(|&n| node_devices(n).len() == g as usize)
                .collect();
            whole_nodes.sort_by(|&x, &y| free(x).total_cmp(&free(y)).then(x.cmp(&y)));
            whole_nodes.truncate((k / g) as usize);
            whole_nodes.into_iter().flat_map(node_devices).collect()
        };
        chosen.sort_unstable();
        let start = chosen
            .iter()
            .map(|&x| devices[x as usize].finish_s)
            .fold(0.0f64, f64::max);
        for &x in &chosen {
            devices[x as usize].finish_s = start + gang.cost.piece_s();
            devices[x as usize].pieces.push(gi);
        }
        gang.devices = chosen;
        gang.start_s = start;
    }

    // Whole samples: LPT by compute onto the trainer free earliest, then each trainer's share
    // packed into the fewest micro-batches of even cost (`pack_even`, as static plans do; a
    // sample over the budget alone), each lasting `max(fixed + compute, transfers)`.
    let mut share: Vec<Vec<usize>> = vec![Vec::new(); d as usize];
    let mut heap: BinaryHeap<Reverse<(Seconds, u32)>> = devices
        .iter()
        .enumerate()
        .map(|(x, a)| Reverse((Seconds(a.finish_s), x as u32)))
        .collect();
    for i in order.iter().copied().filter(|&i| !is_split[i]) {
        let Some(Reverse((Seconds(load), x))) = heap.pop() else {
            break;
        };
        share[x as usize].push(i);
        let load = load + marginal[i];
        heap.push(Reverse((Seconds(load), x)));
    }
    for (dev, samples) in devices.iter_mut().zip(share) {
        let (over, under): (Vec<usize>, Vec<usize>) = samples
            .into_iter()
            .partition(|&i| lengths[i] > packing.budget);
        let packed = pack_even(lengths, marginal, &under, packing.budget).unwrap_or_else(|_| {
            // Unreachable (distinct samples of at most the budget, each with a cost): one per
            // micro-batch is still a plan.
            under.iter().map(|&i| vec![i]).collect()
        });
        for mb in over.into_iter().map(|i| vec![i]).chain(packed) {
            let compute = packing.fixed + mb.iter().map(|&i| marginal[i]).sum::<f64>();
            dev.finish_s += compute.max(packing.transfer);
            dev.micro_batches.push(mb);
        }
    }
    (devices, gangs)
}

/// A totally ordered load for the LPT heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seconds(f64);

impl Eq for Seconds {}

impl PartialOrd for Seconds {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Seconds {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}
