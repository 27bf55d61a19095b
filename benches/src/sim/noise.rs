//! Costs the planner cannot see: a plan made with the cost model's estimates, run paying noisy
//! actual costs ([`Noise`]), as a real cluster runs it.
//!
//! # What the run pays
//!
//! - The draws are [`odc::sim::noise`]'s ([`Noise`]: per sample, per layer of each device's
//!   micro-batch slot, and stragglers), the ones the simulated device of the runtime rows pays.
//! - A micro-batch of compute `c`, transfers `x` and exposed ring exchange `e` over `L` layers
//!   takes per layer `max(c · j_l / (L · v), x / L) + e / L`; with no noise this sums to the
//!   planner's `max(c, x) + e`.
//!
//! # How each side runs
//!
//! - **Lockstep** (FSDP, static and dynamic CP; [`lockstep_s`]): every layer of every round ends
//!   when the slowest device's does, a barrier per layer, as a collective's all-gather and
//!   reduce-scatter impose.
//! - **On demand** ([`unlocked_s`] for a CP placement, [`gangs_s`] for the gangs' plan): a device
//!   runs its micro-batches back to back and waits only for the members of its own gangs, layer
//!   by layer, as their ring paces them.
//!
//! Guarantees (tested): deterministic per seed; with [`Noise::none`] every step equals the
//! planner's; the draws depend only on the seed and the keys above.

use odc_policy::split::{CpPlan, SplitCosts, SplitPlan};

pub use odc::sim::noise::{Noise, ASSUMED_LAYER_SIGMA, CALIBRATED_SAMPLE_SIGMA, STRAGGLER_SPEED};

/// One micro-batch as the run pays it: its noisy compute (fixed cost included), its transfers
/// and its exposed exchange.
#[derive(Debug, Clone, Copy)]
struct Work {
    compute: f64,
    transfer: f64,
    exposed: f64,
}

impl Work {
    /// Its time on layer `l` of `layers` on device `d` in slot `slot`.
    fn layer_s(&self, noise: &Noise, layers: u32, d: u32, slot: usize, l: u32) -> f64 {
        let lf = f64::from(layers.max(1));
        let compute = self.compute * noise.layer_factor(d, slot, l) / (lf * noise.speed(d));
        compute.max(self.transfer / lf) + self.exposed / lf
    }

    /// Its whole time on device `d` in slot `slot`, no one to wait for.
    fn alone_s(&self, noise: &Noise, layers: u32, d: u32, slot: usize) -> f64 {
        (0..layers.max(1))
            .map(|l| self.layer_s(noise, layers, d, slot, l))
            .sum()
    }
}

/// The layers a micro-batch's compute is spread over (the blocks).
fn layers<C: SplitCosts + ?Sized>(costs: &C) -> u32 {
    costs.attention_layers().max(1)
}

/// What each device runs in round `r` of a CP plan, as the run pays it (`None`: nothing).
fn cp_round<C: SplitCosts + ?Sized>(
    plan: &CpPlan,
    r: usize,
    lengths: &[u64],
    costs: &C,
    noise: &Noise,
) -> Vec<Option<Work>> {
    let transfer = costs.pull_s().max(costs.push_s());
    let fixed = costs.fixed_s();
    plan.rounds[r]
        .iter()
        .map(|cell| {
            if cell.samples.is_empty() && cell.pieces.is_empty() {
                return None;
            }
            // The planned compute plus each sample's error on its own marginal compute.
            let mut compute = fixed + cell.compute_s;
            for &s in &cell.samples {
                compute += (noise.sample_factor(s as u64) - 1.0) * costs.sample_s(lengths[s]);
            }
            for &(g, _) in &cell.pieces {
                let gang = &plan.gangs[g];
                let marginal = gang.cost.compute_s - fixed;
                compute += (noise.sample_factor(gang.sample as u64) - 1.0) * marginal;
            }
            Some(Work {
                compute,
                transfer,
                exposed: cell.exposed_s,
            })
        })
        .collect()
}

/// The step of a CP plan (FSDP's is `Static(1)`'s) run in lockstep under `noise`: every layer of
/// every round waits for the slowest device (see the [module docs](self)).
pub fn lockstep_s<C: SplitCosts + ?Sized>(
    plan: &CpPlan,
    lengths: &[u64],
    costs: &C,
    noise: &Noise,
) -> f64 {
    let layers = layers(costs);
    let transfer = costs.pull_s().max(costs.push_s());
    let mut step = 0.0;
    for r in 0..plan.rounds.len() {
        let works = cp_round(plan, r, lengths, costs, noise);
        for l in 0..layers {
            let slowest = works
                .iter()
                .enumerate()
                .map(|(d, w)| match w {
                    Some(w) => w.layer_s(noise, layers, d as u32, r, l),
                    // An empty cell still joins the collective: its transfers.
                    None => transfer / f64::from(layers),
                })
                .fold(0.0, f64::max);
            step += slowest;
        }
    }
    step
}

/// Seconds a group of devices tied by a ring spends on their micro-batches in slot `slot`, layer
/// by layer the slowest of them.
fn tied_s(members: &[(u32, Work)], noise: &Noise, layers: u32, slot: usize) -> f64 {
    (0..layers)
        .map(|l| {
            members
                .iter()
                .map(|(d, w)| w.layer_s(noise, layers, *d, slot, l))
                .fold(0.0, f64::max)
        })
        .sum()
}

/// The step of a CP placement run on demand under `noise`: each device runs its cells in round
/// order; a round's gangs tie their members (directly or through a chain of gangs), who start
/// together when the last is free and pace each other layer by layer; an untied device runs as
/// soon as it is free ([`odc_policy::split::unlocked_step_s`] with noise).
pub fn unlocked_s<C: SplitCosts + ?Sized>(
    plan: &CpPlan,
    lengths: &[u64],
    costs: &C,
    noise: &Noise,
) -> f64 {
    let layers = layers(costs);
    let d = plan.rounds.first().map_or(0, Vec::len);
    let mut free = vec![0.0f64; d];
    for r in 0..plan.rounds.len() {
        let works = cp_round(plan, r, lengths, costs, noise);
        let mut parent: Vec<usize> = (0..d).collect();
        for gang in plan.gangs.iter().filter(|g| g.round == r) {
            for w in gang.devices.windows(2) {
                let (a, b) = (
                    root(&mut parent, w[0] as usize),
                    root(&mut parent, w[1] as usize),
                );
                parent[a] = b;
            }
        }
        let mut groups: std::collections::BTreeMap<usize, Vec<(u32, Work)>> = Default::default();
        for (device, w) in works.iter().enumerate() {
            if let Some(w) = w {
                let g = root(&mut parent, device);
                groups.entry(g).or_default().push((device as u32, *w));
            }
        }
        for members in groups.values() {
            let start = members
                .iter()
                .map(|(m, _)| free[*m as usize])
                .fold(0.0, f64::max);
            let end = start + tied_s(members, noise, layers, r);
            for (m, _) in members {
                free[*m as usize] = end;
            }
        }
    }
    free.into_iter().fold(0.0, f64::max)
}

fn root(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

/// How on demand hands out the whole samples' micro-batches at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Dispatch {
    /// Each device runs the micro-batches the plan gave it (LB-Mini's lists).
    Static,
    /// The plan's micro-batches, costliest planned first, each to the device that is free first
    /// (the supervisor's dynamic dispatch: work flows away from a slow device).
    Dynamic,
}

/// The step of the gangs' plan run on demand under `noise`: gangs first, in order, each starting
/// when the last of its members is free and paced layer by layer by its slowest member; then the
/// micro-batches of whole samples as `dispatch` hands them out, each device running its own back
/// to back. A device's slots count its pieces, then its micro-batches.
pub fn gangs_s<C: SplitCosts + ?Sized>(
    plan: &SplitPlan,
    lengths: &[u64],
    costs: &C,
    noise: &Noise,
    dispatch: Dispatch,
) -> f64 {
    let layers = layers(costs);
    let fixed = costs.fixed_s();
    let transfer = costs.pull_s().max(costs.push_s());
    let mut free = vec![0.0f64; plan.devices.len()];
    let mut slot = vec![0usize; plan.devices.len()];
    let mut order: Vec<usize> = (0..plan.gangs.len()).collect();
    order.sort_by(|&a, &b| {
        plan.gangs[a]
            .start_s
            .total_cmp(&plan.gangs[b].start_s)
            .then(a.cmp(&b))
    });
    for g in order {
        let gang = &plan.gangs[g];
        let marginal = gang.cost.compute_s - fixed;
        let work = Work {
            compute: gang.cost.compute_s
                + (noise.sample_factor(gang.sample as u64) - 1.0) * marginal,
            transfer: gang.cost.transfer_s,
            exposed: gang.cost.comm_exposed_s,
        };
        let start = gang
            .devices
            .iter()
            .map(|&m| free[m as usize])
            .fold(0.0, f64::max);
        // The members' slots differ; each member draws its own layers at its own slot.
        let duration: f64 = (0..layers)
            .map(|l| {
                gang.devices
                    .iter()
                    .map(|&m| work.layer_s(noise, layers, m, slot[m as usize], l))
                    .fold(0.0, f64::max)
            })
            .sum();
        for &m in &gang.devices {
            free[m as usize] = start + duration;
            slot[m as usize] += 1;
        }
    }
    let work = |mb: &[usize]| Work {
        compute: fixed
            + mb.iter()
                .map(|&s| noise.sample_factor(s as u64) * costs.sample_s(lengths[s]))
                .sum::<f64>(),
        transfer,
        exposed: 0.0,
    };
    // Planned cost, costliest first (a stable sort: ties keep device and position order).
    let planned = |mb: &[usize]| -> f64 { mb.iter().map(|&s| costs.sample_s(lengths[s])).sum() };
    let mut queue: Vec<(usize, &[usize])> = plan
        .devices
        .iter()
        .enumerate()
        .flat_map(|(d, a)| a.micro_batches.iter().map(move |mb| (d, mb.as_slice())))
        .collect();
    if dispatch == Dispatch::Dynamic {
        queue.sort_by(|a, b| planned(b.1).total_cmp(&planned(a.1)));
    }
    for (listed, mb) in queue {
        let d = match dispatch {
            Dispatch::Static => listed,
            Dispatch::Dynamic => (0..free.len())
                .min_by(|&a, &b| free[a].total_cmp(&free[b]).then(a.cmp(&b)))
                .unwrap_or(listed),
        };
        free[d] += work(mb).alone_s(noise, layers, d as u32, slot[d]);
        slot[d] += 1;
    }
    free.into_iter().fold(0.0, f64::max)
}

/// Perfect balance of the actual costs: every sample's noisy marginal compute plus the plan's
/// fixed costs, over the devices' summed speeds.
pub fn perfect_s<C: SplitCosts + ?Sized>(
    lengths: &[u64],
    micro_batches: u64,
    costs: &C,
    noise: &Noise,
) -> f64 {
    let work: f64 = lengths
        .iter()
        .enumerate()
        .map(|(s, &t)| noise.sample_factor(s as u64) * costs.sample_s(t))
        .sum::<f64>()
        + costs.fixed_s() * micro_batches as f64;
    let speed: f64 = (0..costs.devices()).map(|d| noise.speed(d)).sum();
    work / speed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::profile::{DeviceProfile, ModelShape};
    use crate::sim::split::{plan, plan_cp, Modelled, SplitOptions};
    use crate::sim::topology::Topology;
    use crate::workload::Workload;
    use odc_policy::split::{unlocked_step_s, ContextParallel};

    fn seven_b() -> DeviceProfile {
        DeviceProfile::builtin(ModelShape::B7, 28).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn without_noise_every_side_pays_what_the_planner_planned() {
        let profile = seven_b();
        let topology = Topology::h100_devices(64).unwrap();
        let costs = Modelled {
            profile: &profile,
            topology: &topology,
        };
        let lengths = Workload::LongAlign.sample(64, 0);
        let none = Noise::none();
        for cp in [
            ContextParallel::Off,
            ContextParallel::Static(8),
            ContextParallel::Dynamic,
        ] {
            let p = plan_cp(&lengths, &profile, &topology, cp, 131_072).unwrap();
            assert!(
                close(lockstep_s(&p, &lengths, &costs, &none), p.step_s),
                "{cp}"
            );
            let unlocked = unlocked_s(&p, &lengths, &costs, &none);
            assert!(close(unlocked, unlocked_step_s(&p)), "{cp}: {unlocked}");
        }
        let options = SplitOptions {
            token_budget: 131_072,
            ..SplitOptions::default()
        };
        let gangs = plan(&lengths, &profile, &topology, options).unwrap();
        assert!(!gangs.gangs.is_empty());
        let got = gangs_s(&gangs, &lengths, &costs, &none, Dispatch::Static);
        assert!(close(got, gangs.step_s), "{got} vs {}", gangs.step_s);
        // Handed out at run time the same micro-batches never end later than the plan's lists
        // here (LPT onto the free devices), and never below perfect balance.
        let dynamic = gangs_s(&gangs, &lengths, &costs, &none, Dispatch::Dynamic);
        let perfect = gangs.perfect_s;
        assert!(dynamic >= perfect - 1e-9, "{dynamic} vs {perfect}");
    }

    #[test]
    fn under_noise_lockstep_pays_its_barriers_and_on_demand_does_not() {
        // Balanced samples: the planner sees nothing to gain; the noise decides.
        let profile = seven_b();
        let topology = Topology::h100_devices(64).unwrap();
        let costs = Modelled {
            profile: &profile,
            topology: &topology,
        };
        let lengths = Workload::Balanced { tokens: 16_384 }.sample(256, 0);
        let p = plan_cp(&lengths, &profile, &topology, ContextParallel::Off, 65_536).unwrap();
        let none = Noise::none();
        let jitter = Noise {
            straggler_every: 0,
            ..Noise::calibrated(1)
        };
        let planned = lockstep_s(&p, &lengths, &costs, &none);
        let lockstep = lockstep_s(&p, &lengths, &costs, &jitter);
        let on_demand = unlocked_s(&p, &lengths, &costs, &jitter);
        // The same placement: without barriers it is never slower, and here clearly faster.
        assert!(on_demand < lockstep, "{on_demand} vs {lockstep}");
        assert!(lockstep / on_demand > 1.05, "{lockstep} / {on_demand}");
        assert!(lockstep > planned, "{lockstep} vs {planned}");
        // A straggler slows both; the lockstep side at every layer.
        let straggling = Noise::calibrated(1);
        assert!(lockstep_s(&p, &lengths, &costs, &straggling) > lockstep);
        assert!(unlocked_s(&p, &lengths, &costs, &straggling) >= on_demand);
        // Dynamic dispatch moves work away from the straggler: the gangs' plan (no gangs here,
        // LB-Mini's lists of one-sample micro-batches) handed out at run time beats its own lists.
        let options = SplitOptions {
            token_budget: 16_384,
            ..SplitOptions::default()
        };
        let lists = plan(&lengths, &profile, &topology, options).unwrap();
        let fixed = gangs_s(&lists, &lengths, &costs, &straggling, Dispatch::Static);
        let moved = gangs_s(&lists, &lengths, &costs, &straggling, Dispatch::Dynamic);
        assert!(moved < fixed, "{moved} vs {fixed}");
    }
}
