//! The planner's guarantees (module docs of [`super::plan`]), on a toy cost model: a quadratic
//! sample cost whose quadratic part is attention, links and transfers set per test.

use proptest::prelude::*;

use super::*;

/// `sample(s) = a·s² + b·s` (the `a` part is attention, spread over `layers`).
#[derive(Debug, Clone)]
pub(super) struct Toy {
    pub(super) devices: u32,
    pub(super) per_node: u32,
    pub(super) fixed: f64,
    pub(super) a: f64,
    pub(super) b: f64,
    pub(super) layers: u32,
    pub(super) kv_bytes: u64,
    pub(super) intra: Link,
    pub(super) inter: Link,
    pub(super) pull: f64,
    pub(super) push: f64,
    /// Seconds of each ring step's own launches and merges.
    pub(super) step: f64,
}

impl Toy {
    /// Seconds-ish figures of a 7B-like model on H100s: 32K tokens ≈ 5.5 s of compute.
    pub(super) fn h100(devices: u32) -> Self {
        Toy {
            devices,
            per_node: 8,
            fixed: 0.01,
            a: 2.0e-9,
            b: 1.0e-4,
            layers: 28,
            kv_bytes: 2048,
            intra: Link {
                bytes_per_s: 450e9,
                latency_s: 5e-6,
            },
            inter: Link {
                bytes_per_s: 50e9,
                latency_s: 10e-6,
            },
            pull: 0.0,
            push: 0.0,
            step: 0.0,
        }
    }
}

impl SplitCosts for Toy {
    fn devices(&self) -> u32 {
        self.devices
    }
    fn devices_per_node(&self) -> u32 {
        self.per_node
    }
    fn fixed_s(&self) -> f64 {
        self.fixed
    }
    fn sample_s(&self, tokens: u64) -> f64 {
        let s = tokens as f64;
        self.a * s * s + self.b * s
    }
    fn layer_attention_s(&self, tokens: u64) -> f64 {
        let s = tokens as f64;
        self.a * s * s / f64::from(self.layers.max(1))
    }
    fn attention_layers(&self) -> u32 {
        self.layers
    }
    fn ring_step_overhead_s(&self, _chunk_tokens: u64) -> f64 {
        self.step
    }
    fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes
    }
    fn ring_link(&self, inter_node: bool) -> Link {
        if inter_node {
            self.inter
        } else {
            self.intra
        }
    }
    fn pull_s(&self) -> f64 {
        self.pull
    }
    fn push_s(&self) -> f64 {
        self.push
    }
}

fn unsplit() -> SplitOptions {
    SplitOptions {
        split: false,
        ..SplitOptions::default()
    }
}

/// Every sample placed exactly once, whole or as one piece on each of `k` distinct trainers of its
/// gang, and each gang's sample cuttable for its `k`.
fn assert_exactly_once(plan: &SplitPlan, lengths: &[u64]) {
    let mut seen = vec![0usize; lengths.len()];
    for a in &plan.devices {
        for mb in &a.micro_batches {
            assert!(!mb.is_empty());
            for &i in mb {
                seen[i] += 1;
            }
        }
    }
    for (gi, g) in plan.gangs.iter().enumerate() {
        assert_eq!(g.devices.len(), g.cost.k as usize);
        assert!(g.cost.k >= 2);
        assert!(g.devices.windows(2).all(|w| w[0] < w[1]), "distinct: {g:?}");
        for &x in &g.devices {
            assert!(plan.devices[x as usize].pieces.contains(&gi));
        }
        assert_eq!(g.tokens, lengths[g.sample]);
        zigzag(g.tokens, g.cost.k).expect("a gang's sample can be cut for it");
        seen[g.sample] += 1;
    }
    assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
}

#[test]
fn one_huge_sample_is_split_and_the_step_nears_perfect_balance() {
    let costs = Toy::h100(64);
    let mut lengths = vec![131_072];
    lengths.extend(std::iter::repeat_n(4096, 255));
    let without = plan(&lengths, &costs, unsplit()).unwrap();
    let with = plan(&lengths, &costs, SplitOptions::default()).unwrap();
    assert_exactly_once(&without, &lengths);
    assert_exactly_once(&with, &lengths);
    assert!(without.gangs.is_empty());
    assert_eq!(with.gangs.len(), 1);
    assert_eq!(with.gangs[0].sample, 0);
    assert!(without.step_s > 2.0 * without.perfect_s, "{without:?}");
    assert!((without.step_s - without.achievable_unsplit_s).abs() < 1e-9);
    let ratio = with.step_s / with.perfect_s;
    assert!((1.0..1.10).contains(&ratio), "{ratio}");
}

#[test]
fn a_balanced_step_splits_nothing_and_plans_as_unsplit() {
    let costs = Toy::h100(16);
    let lengths = vec![16_384; 64];
    let with = plan(&lengths, &costs, SplitOptions::default()).unwrap();
    assert!(with.gangs.is_empty());
    assert_eq!(with, plan(&lengths, &costs, unsplit()).unwrap());
    assert!(
        (with.step_s / with.perfect_s - 1.0).abs() < 1e-9,
        "{with:?}"
    );
}

#[test]
fn a_slow_link_makes_splitting_lose() {
    let fast = Toy::h100(8);
    let slow = Toy {
        intra: Link {
            bytes_per_s: 1e8,
            latency_s: 1e-3,
        },
        ..fast.clone()
    };
    let mut lengths = vec![32_768];
    lengths.extend(std::iter::repeat_n(2048, 8));
    for k in 2..=8 {
        let f = piece_cost(&fast, 32_768, k);
        let s = piece_cost(&slow, 32_768, k);
        assert_eq!(f.compute_s, s.compute_s);
        assert!(s.comm_exposed_s > f.comm_exposed_s, "k={k}");
    }
    let on_fast = plan(&lengths, &fast, SplitOptions::default()).unwrap();
    let on_slow = plan(&lengths, &slow, SplitOptions::default()).unwrap();
    assert_eq!(on_fast.gangs.len(), 1);
    assert!(on_slow.gangs.is_empty(), "{:?}", on_slow.gangs);
    assert!(on_fast.step_s < on_slow.step_s);
}

#[test]
fn ring_exchange_hides_behind_attention_for_long_samples_on_fast_links() {
    let costs = Toy::h100(64);
    let inside = piece_cost(&costs, 131_072, 8);
    assert!(!inside.inter_node);
    assert_eq!(inside.comm_exposed_s, 0.0);
    let across = piece_cost(&costs, 8192, 64);
    assert!(across.inter_node);
    assert!(across.comm_exposed_s > 0.0, "{across:?}");
    // Never cheaper per member than a sample of the chunk's length.
    assert!(across.compute_s >= costs.fixed_s() + costs.sample_s(128) - 1e-12);
}

#[test]
fn every_ring_step_adds_its_own_cost_beside_the_hidden_hop() {
    let free = Toy::h100(64);
    let priced = Toy {
        step: 1e-4,
        ..free.clone()
    };
    for k in [2, 4, 8] {
        let (f, p) = (
            piece_cost(&free, 131_072, k),
            piece_cost(&priced, 131_072, k),
        );
        assert_eq!(f.comm_exposed_s, 0.0, "k={k}: the hop hides");
        let want = 28.0 * f64::from(k - 1) * 1e-4;
        assert!((p.comm_exposed_s - want).abs() < 1e-12, "k={k}: {p:?}");
        assert_eq!(p.compute_s, f.compute_s);
    }
}

#[test]
fn a_piece_waits_for_its_transfers_so_pull_bound_samples_stay_whole() {
    // A 4K sample computes in ~0.44 s, over the balanced step of 1K samples: worth splitting on
    // compute alone, not when every piece waits 0.6 s for its pulls.
    let mut lengths = vec![4096];
    lengths.extend(std::iter::repeat_n(1024, 63));
    let free = Toy::h100(64);
    let ignored = plan(&lengths, &free, SplitOptions::default()).unwrap();
    assert!(ignored.gangs.iter().any(|g| g.sample == 0), "{ignored:?}");
    for (pull, push) in [(0.6, 0.0), (0.0, 0.6), (0.6, 0.3)] {
        let costs = Toy {
            pull,
            push,
            ..free.clone()
        };
        for k in gang_sizes(64, 8) {
            assert!(piece_cost(&costs, 4096, k).piece_s() >= 0.6, "k={k}");
        }
        let with = plan(&lengths, &costs, SplitOptions::default()).unwrap();
        assert!(with.gangs.is_empty(), "{:?}", with.gangs);
        assert!((with.step_s - 0.6).abs() < 1e-12, "{with:?}");
        assert!(with.perfect_s < 0.6, "perfect balance stays compute only");
    }
}

#[test]
fn min_tokens_keeps_shorter_samples_whole() {
    let costs = Toy::h100(64);
    let mut lengths = vec![131_072, 65_536];
    lengths.extend(std::iter::repeat_n(2048, 254));
    let all = plan(&lengths, &costs, SplitOptions::default()).unwrap();
    assert_eq!(all.gangs.len(), 2, "{:?}", all.gangs);
    let only_longest = plan(
        &lengths,
        &costs,
        SplitOptions {
            min_tokens: 100_000,
            ..SplitOptions::default()
        },
    )
    .unwrap();
    assert_eq!(only_longest.gangs.len(), 1);
    assert_eq!(only_longest.gangs[0].sample, 0);
}

/// A sample over the budget must be split (`pieces_within_budget`) into pieces that fit it,
/// even where splitting it does not pay; where no gang can, an error naming the sample.
#[test]
fn a_sample_over_the_budget_is_split_into_pieces_within_it() {
    let costs = Toy::h100(8);
    let options = SplitOptions {
        token_budget: 16_384,
        pieces_within_budget: true,
        ..SplitOptions::default()
    };
    // 8 samples of 8,192 beside one of 40,000: at least 3 members (pieces of 13,334 at most).
    let mut lengths = vec![40_000];
    lengths.extend(std::iter::repeat_n(8192, 8));
    let p = plan(&lengths, &costs, options).unwrap();
    assert_exactly_once(&p, &lengths);
    let gang = p.gangs.iter().find(|g| g.sample == 0).expect("split");
    assert!(gang.cost.k >= 3, "{gang:?}");
    let cut = crate::split::zigzag(40_000, gang.cost.k).unwrap();
    for member in &cut {
        assert!(member.iter().map(|r| r.end - r.start).sum::<u64>() <= 16_384);
    }
    // Only whole samples within the budget stay whole.
    for a in &p.devices {
        for mb in &a.micro_batches {
            assert!(mb.iter().map(|&i| lengths[i]).sum::<u64>() <= 16_384);
        }
    }
    // Even where the split costs more than the whole sample (a transfer floor of an hour).
    let slow = Toy {
        pull: 3600.0,
        ..costs.clone()
    };
    assert!(!plan(&lengths, &slow, options).unwrap().gangs.is_empty());
    // Without the flag it runs whole, alone, where splitting does not pay.
    let whole = plan(
        &lengths,
        &slow,
        SplitOptions {
            pieces_within_budget: false,
            ..options
        },
    );
    assert!(whole.unwrap().gangs.is_empty());
    // A gang of at most 2 cannot cut 40,000 tokens into pieces of 16,384.
    let e = plan(
        &lengths,
        &costs,
        SplitOptions {
            max_gang: 2,
            ..options
        },
    )
    .unwrap_err();
    assert_eq!(
        e,
        SplitError::PiecesOverBudget {
            sample: 0,
            tokens: 40_000,
            budget: 16_384
        }
    );
    assert!(e.to_string().contains("sample 0 has 40000 tokens"), "{e}");
}

#[test]
fn bad_inputs_are_errors_naming_what_was_wrong() {
    let costs = Toy::h100(8);
    let none = Toy {
        devices: 0,
        ..costs.clone()
    };
    assert_eq!(
        plan(&[1], &none, SplitOptions::default()),
        Err(SplitError::NoDevices)
    );
    let no_node = Toy {
        per_node: 0,
        ..costs.clone()
    };
    assert_eq!(
        plan(&[1], &no_node, SplitOptions::default()),
        Err(SplitError::NoDevicesPerNode)
    );
    let no_budget = SplitOptions {
        token_budget: 0,
        ..SplitOptions::default()
    };
    assert_eq!(plan(&[1], &costs, no_budget), Err(SplitError::NoBudget));
    let negative = Toy {
        b: -1.0,
        ..costs.clone()
    };
    let e = plan(&[0, 5], &negative, SplitOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("sample_s of sample 1 is -4.9"),
        "{e}"
    );
    let nan = Toy {
        pull: f64::NAN,
        ..costs
    };
    let e = plan(&[1], &nan, SplitOptions::default()).unwrap_err();
    assert!(e.to_string().starts_with("pull_s is NaN"), "{e}");
    // A ring step's own cost that is no number is named, not clamped away.
    let nan_step = Toy {
        step: f64::NAN,
        ..Toy::h100(8)
    };
    let e =
        super::plan_cp(&[65_536], &nan_step, ContextParallel::Static(2), 65_536, 0).unwrap_err();
    assert!(e.to_string().contains("ring exchange"), "{e}");
    let empty = plan(&[], &Toy::h100(8), SplitOptions::default()).unwrap();
    assert_eq!((empty.step_s, empty.perfect_s), (0.0, 0.0));
}

/// Lengths drawn like a long-tailed workload: mostly short, some very long.
fn lengths() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(
        prop_oneof![
            8 => 1u64..4096,
            3 => 4096u64..32_768,
            1 => 32_768u64..262_144,
        ],
        0..96,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn plans_place_every_sample_once_and_never_lengthen_the_step(
        lengths in lengths(),
        devices in 1u32..80,
        per_node in 1u32..9,
        pull in prop_oneof![Just(0.0), 0.0f64..2.0],
        push in prop_oneof![Just(0.0), 0.0f64..1.0],
        nic in prop_oneof![Just(50e9), 1e8f64..1e11],
        budget in prop_oneof![Just(DEFAULT_TOKEN_BUDGET), 1024u64..200_000],
    ) {
        let costs = Toy {
            per_node,
            pull,
            push,
            inter: Link { bytes_per_s: nic, latency_s: 1e-5 },
            ..Toy::h100(devices)
        };
        let options = SplitOptions { token_budget: budget, ..SplitOptions::default() };
        let with = plan(&lengths, &costs, options).unwrap();
        let without = plan(&lengths, &costs, SplitOptions { split: false, ..options }).unwrap();
        assert_exactly_once(&with, &lengths);
        assert_exactly_once(&without, &lengths);
        prop_assert!(without.gangs.is_empty());
        // Splitting never lengthens the modelled step; a plan with gangs is strictly shorter.
        prop_assert!(with.step_s <= without.step_s);
        if !with.gangs.is_empty() {
            prop_assert!(with.step_s < without.step_s);
        }
        prop_assert!(without.step_s >= without.perfect_s * (1.0 - 1e-12));
        prop_assert!(with.achievable_unsplit_s >= with.perfect_s);
        // Gangs within a node stay in it; wider ones take whole nodes.
        for g in &with.gangs {
            if g.cost.k <= per_node {
                let node = g.devices[0] / per_node;
                prop_assert!(g.devices.iter().all(|&x| x / per_node == node), "{g:?}");
            } else {
                prop_assert_eq!(g.cost.k % per_node, 0);
            }
        }
        // Deterministic.
        prop_assert_eq!(&with, &plan(&lengths, &costs, options).unwrap());
    }
}
