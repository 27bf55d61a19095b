//! Model layout and sharding arithmetic.
//!
//! A model is an ordered list of **units** (FSDP's FlatParameter: the parameters gathered together).
//! Each unit is split over `S` shard servers in contiguous **shards**: shard `i` of a unit of `n`
//! elements is `i·n/S .. (i+1)·n/S` (integer division), so shards differ in length by at most one
//! and together cover the unit exactly once ([`shard_range`], property-tested).
//!
//! A unit is **trainable** (the default) or **frozen** ([`UnitSpec::frozen`]): a frozen unit is
//! pulled like any other and never pushed, reduced or optimised. Guarantees (tested in
//! `server/actor.rs`, `trainer/context.rs` and `tests/runtime/frozen.rs`):
//! - a shard server keeps for a frozen unit only what is read — its master values and the
//!   published copy — with no accumulator region (its route has none) and no optimizer state
//!   (its optimizer snapshot: 0 steps, no buffers);
//! - its values stay bit-identical to their initial values whatever the optimizer (no weight
//!   decay), and it adds nothing to the gradient's sum of squares;
//! - it follows the version protocol (I1): every read during step `v` returns version `v`;
//! - `odc_actors::trainer::TrainerContext::push_grad` on it is
//!   `odc_actors::Error::FrozenUnit`, and nothing is sent;
//! - trainable units train exactly as if the frozen unit were a constant (I3).
//!
//! A layout that breaks these rules, and a unit that is not in it, is a [`LayoutError`] naming the
//! unit (the runtime's `odc_actors::Error` has a variant for each, with the same message).

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use crate::UnitId;

/// What is wrong with a model layout, or with a unit asked of it.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum LayoutError {
    /// The layout breaks a rule of [`ModelLayout::new`] or [`ModelLayout::with_optimizer_init`],
    /// or a unit's values cannot be read ([`UnitInit::slice`]); the message names the unit.
    #[error("invalid model layout: {0}")]
    Invalid(String),
    #[error("unknown unit {unit}: the model has {units} units")]
    UnknownUnit { unit: UnitId, units: u64 },
}

type Result<T> = std::result::Result<T, LayoutError>;

/// Reads a range of a unit's values ([`UnitInit::Slice`]), or says why it cannot.
pub type SliceFn = dyn Fn(Range<usize>) -> std::result::Result<Vec<f32>, String> + Send + Sync;

/// Initial values of a unit, materialised only shard by shard at the owning server.
#[derive(Clone)]
pub enum UnitInit {
    /// Every element equals the constant.
    Constant(f32),
    /// Explicit values; their count must equal the unit's length.
    Values(Arc<[f32]>),
    /// Value of element `i`.
    Fn(Arc<dyn Fn(usize) -> f32 + Send + Sync>),
    /// Values of a range of elements, read on demand — from a memory-mapped checkpoint, say, so
    /// that a shard server converts only its own shard. Must return exactly `range.len()` values
    /// for every range within the unit, or say why it cannot (a file that is not there).
    Slice(Arc<SliceFn>),
}

impl std::fmt::Debug for UnitInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitInit::Constant(c) => write!(f, "Constant({c})"),
            UnitInit::Values(v) => write!(f, "Values(len {})", v.len()),
            UnitInit::Fn(_) => write!(f, "Fn"),
            UnitInit::Slice(_) => write!(f, "Slice"),
        }
    }
}

impl UnitInit {
    /// The initial values of `range` of the unit; an error only where a [`UnitInit::Slice`]
    /// cannot read them (or returns another count), naming the range.
    pub fn slice(&self, range: Range<usize>) -> Result<Vec<f32>> {
        match self {
            UnitInit::Constant(c) => Ok(vec![*c; range.len()]),
            UnitInit::Values(v) => Ok(v[range].to_vec()),
            UnitInit::Fn(f) => Ok(range.map(|i| f(i)).collect()),
            UnitInit::Slice(f) => {
                let values = f(range.clone()).map_err(|e| {
                    LayoutError::Invalid(format!("reading elements {range:?}: {e}"))
                })?;
                if values.len() != range.len() {
                    return Err(LayoutError::Invalid(format!(
                        "reading elements {range:?}: {} values came back",
                        values.len()
                    )));
                }
                Ok(values)
            }
        }
    }

    /// Adds what identifies these values to a layout digest: explicit values by value, the
    /// others by kind.
    fn digest(&self, h: &mut Fnv) {
        match self {
            UnitInit::Constant(c) => {
                h.bytes(&[0]);
                h.bytes(&c.to_bits().to_le_bytes());
            }
            UnitInit::Values(v) => {
                h.bytes(&[1]);
                for x in v.iter() {
                    h.bytes(&x.to_bits().to_le_bytes());
                }
            }
            UnitInit::Fn(_) => h.bytes(&[2]),
            UnitInit::Slice(_) => h.bytes(&[3]),
        }
    }
}

/// One unit: a name, its length in elements, its initial values and whether it trains.
#[derive(Debug, Clone)]
pub struct UnitSpec {
    pub name: String,
    pub len: usize,
    pub init: UnitInit,
    /// `false`: a frozen unit, pulled and never pushed, reduced or optimised (see the
    /// [module docs](self)). [`UnitSpec::with_values`] and [`UnitSpec::constant`] make trainable
    /// units; [`UnitSpec::frozen`] freezes one.
    pub trainable: bool,
    /// `true`: a frozen unit served for readers outside the trainers ([`UnitSpec::served`]),
    /// not part of the job's parameters or checkpoints.
    pub served: bool,
}

impl UnitSpec {
    /// A trainable unit of `len` elements starting from `init`.
    pub fn from_init(name: impl Into<String>, len: usize, init: UnitInit) -> Self {
        UnitSpec {
            name: name.into(),
            len,
            init,
            trainable: true,
            served: false,
        }
    }

    /// A trainable unit with explicit initial values.
    pub fn with_values(name: impl Into<String>, values: Vec<f32>) -> Self {
        Self::from_init(name, values.len(), UnitInit::Values(values.into()))
    }

    /// A trainable unit of `len` elements all equal to `value`.
    pub fn constant(name: impl Into<String>, len: usize, value: f32) -> Self {
        Self::from_init(name, len, UnitInit::Constant(value))
    }

    /// The same unit, frozen: its shard servers keep no gradient accumulator and no optimizer
    /// state for it, its values never change, and pushing its gradient is an error.
    ///
    /// ```
    /// use odc_policy::layout::{ModelLayout, UnitSpec};
    /// let layout = ModelLayout::new(vec![
    ///     UnitSpec::constant("base", 1000, 0.5).frozen(),
    ///     UnitSpec::constant("adapter", 10, 0.0),
    /// ])
    /// .unwrap();
    /// assert!(!layout.units()[0].trainable);
    /// assert_eq!((layout.trainable_elements(), layout.frozen_elements()), (10, 1000));
    /// ```
    pub fn frozen(mut self) -> Self {
        self.trainable = false;
        self
    }

    /// The same unit, frozen and **served**: kept by the shard servers and read like any frozen
    /// unit (RL's reference model, which the sampler reads as the policy's units are read), but
    /// not part of the model the job trains — its parameters, its train state and its
    /// checkpoints leave it out, and a resumed job takes it from its initial values; a shard
    /// server keeps only its published copy (no master values, which nothing reads). Served
    /// units come after every other unit ([`ModelLayout::new`]).
    ///
    /// ```
    /// use odc_policy::layout::{ModelLayout, UnitSpec};
    /// let layout = ModelLayout::new(vec![
    ///     UnitSpec::constant("policy", 10, 0.5),
    ///     UnitSpec::constant("reference.policy", 10, 0.5).served(),
    /// ])
    /// .unwrap();
    /// assert_eq!(layout.model_units(), 1);
    /// assert!(!layout.units()[1].trainable);
    /// ```
    pub fn served(mut self) -> Self {
        self.trainable = false;
        self.served = true;
        self
    }
}

/// How many of `units` come before the first served one ([`UnitSpec::served`]): the model's.
pub fn model_units(units: &[UnitSpec]) -> usize {
    units.iter().take_while(|u| !u.served).count()
}

/// The optimizer state a unit starts from (a job resumed from a checkpoint): the optimizer's step
/// count and its named per-element buffers over the whole unit (see
/// [`OptimizerState::restore`](crate::optimizer::OptimizerState::restore)). Each shard
/// server takes its range.
/// The default, 0 steps and no buffers, is a fresh state: what a frozen unit's checkpoint holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnitOptimizerInit {
    pub steps: u64,
    pub buffers: Vec<(String, Arc<[f32]>)>,
}

/// Where a unit's optimizer state starts from, read shard by shard at the owning server as a
/// unit's values are ([`UnitInit`]): the step count and, per named buffer, its values over the
/// whole unit — explicit ([`UnitOptimizerInit`]), or read on demand from a memory-mapped
/// checkpoint so that a server reads only its own range. The default is a fresh state.
#[derive(Debug, Clone, Default)]
pub struct OptimizerInit {
    pub steps: u64,
    pub buffers: Vec<(String, UnitInit)>,
}

impl From<UnitOptimizerInit> for OptimizerInit {
    fn from(state: UnitOptimizerInit) -> Self {
        OptimizerInit {
            steps: state.steps,
            buffers: state
                .buffers
                .into_iter()
                .map(|(name, values)| (name, UnitInit::Values(values)))
                .collect(),
        }
    }
}

/// The ordered units of a model (and, for a resumed job, their optimizer state). Validated on construction: at least one unit, no empty unit,
/// unique names, explicit values matching the unit's length.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    units: Vec<UnitSpec>,
    /// Per unit, the optimizer state to start from (`None`: fresh).
    optimizer: Option<Arc<[OptimizerInit]>>,
}

impl ModelLayout {
    pub fn new(units: Vec<UnitSpec>) -> Result<Self> {
        if units.is_empty() {
            return Err(LayoutError::Invalid(
                "a model needs at least one unit".into(),
            ));
        }
        let mut names = std::collections::HashSet::new();
        if let Some(u) = units[model_units(&units)..].iter().find(|u| !u.served) {
            return Err(LayoutError::Invalid(format!(
                "unit {} comes after a served unit: served units come last",
                u.name
            )));
        }
        for (id, u) in units.iter().enumerate() {
            if u.len == 0 {
                return Err(LayoutError::Invalid(format!(
                    "unit {id} ({}) has no elements",
                    u.name
                )));
            }
            if !names.insert(u.name.as_str()) {
                return Err(LayoutError::Invalid(format!(
                    "unit name {:?} is used twice",
                    u.name
                )));
            }
            if let UnitInit::Values(v) = &u.init {
                if v.len() != u.len {
                    return Err(LayoutError::Invalid(format!(
                        "unit {id} ({}) has {} elements but {} initial values",
                        u.name,
                        u.len,
                        v.len()
                    )));
                }
            }
        }
        Ok(ModelLayout {
            units,
            optimizer: None,
        })
    }

    /// The same model starting from `states` (one per unit, in order): the optimizer state of a
    /// resumed run. Fails naming the unit and buffer whose length does not match. A frozen unit
    /// has no optimizer state: whatever `states` holds for it is dropped (0 steps, no buffers), as
    /// when a run resumes with a unit it trained now frozen.
    pub fn with_optimizer_state(self, states: Vec<UnitOptimizerInit>) -> Result<Self> {
        self.with_optimizer_init(states.into_iter().map(OptimizerInit::from).collect())
    }

    /// [`Self::with_optimizer_state`] from states whose buffers may be read on demand
    /// ([`OptimizerInit`]); explicit buffers are checked against the unit's length here, the
    /// others when a server reads its range.
    pub fn with_optimizer_init(mut self, mut states: Vec<OptimizerInit>) -> Result<Self> {
        if states.len() != self.units.len() {
            return Err(LayoutError::Invalid(format!(
                "optimizer state for {} units, the model has {}",
                states.len(),
                self.units.len()
            )));
        }
        for (id, (unit, state)) in self.units.iter().zip(&mut states).enumerate() {
            if !unit.trainable {
                *state = OptimizerInit::default();
                continue;
            }
            for (name, init) in &state.buffers {
                let UnitInit::Values(values) = init else {
                    continue;
                };
                if values.len() != unit.len {
                    return Err(LayoutError::Invalid(format!(
                        "unit {id} ({}) has {} elements but its optimizer buffer `{name}` has {}",
                        unit.name,
                        unit.len,
                        values.len()
                    )));
                }
            }
        }
        self.optimizer = Some(states.into());
        Ok(self)
    }

    /// The optimizer state unit `unit` starts from, if the job resumes one.
    pub fn optimizer_init(&self, unit: UnitId) -> Option<&OptimizerInit> {
        self.optimizer.as_ref()?.get(unit as usize)
    }

    pub fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    /// The units of the model the job trains: every unit before the served ones
    /// ([`UnitSpec::served`]), whose values are the job's parameters and checkpoints.
    pub fn model_units(&self) -> usize {
        model_units(&self.units)
    }

    pub fn len(&self) -> usize {
        self.units.len()
    }

    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// The unit `unit`, or [`LayoutError::UnknownUnit`].
    pub fn unit(&self, unit: UnitId) -> Result<&UnitSpec> {
        self.units
            .get(unit as usize)
            .ok_or(LayoutError::UnknownUnit {
                unit,
                units: self.units.len() as u64,
            })
    }

    /// The id of the unit named `name`.
    pub fn find(&self, name: &str) -> Option<UnitId> {
        self.units
            .iter()
            .position(|u| u.name == name)
            .map(|u| u as UnitId)
    }

    /// The ids of every unit, in order.
    pub fn unit_ids(&self) -> std::ops::Range<UnitId> {
        0..self.units.len() as UnitId
    }

    /// Total number of parameters.
    pub fn total_elements(&self) -> usize {
        self.units.iter().map(|u| u.len).sum()
    }

    /// Parameters of trainable units.
    pub fn trainable_elements(&self) -> usize {
        self.units
            .iter()
            .filter(|u| u.trainable)
            .map(|u| u.len)
            .sum()
    }

    /// Parameters of frozen units ([`UnitSpec::frozen`]).
    pub fn frozen_elements(&self) -> usize {
        self.total_elements() - self.trainable_elements()
    }

    /// A fingerprint of the model (FNV-1a over unit names, lengths, whether each trains, and the
    /// bits of explicit and constant initial values; an initialiser function or slice reader
    /// counts by its place only, as it is not materialised here): processes of one job compare
    /// it before any of them serves a shard.
    pub fn digest(&self) -> u64 {
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        for u in &self.units {
            h.bytes(u.name.as_bytes());
            h.bytes(&(u.len as u64).to_le_bytes());
            h.bytes(&[u8::from(u.trainable), u8::from(u.served)]);
            u.init.digest(&mut h);
        }
        for state in self.optimizer.iter().flat_map(|s| s.iter()) {
            h.bytes(&state.steps.to_le_bytes());
            for (name, init) in &state.buffers {
                h.bytes(name.as_bytes());
                init.digest(&mut h);
            }
        }
        h.0
    }
}

/// 64-bit FNV-1a.
struct Fnv(u64);

impl Fnv {
    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The element range of shard `shard` of a unit of `len` elements split over `servers` servers.
///
/// ```
/// use odc_policy::layout::shard_range;
/// assert_eq!(shard_range(10, 3, 0), 0..3);
/// assert_eq!(shard_range(10, 3, 2), 6..10);
/// ```
pub fn shard_range(len: usize, servers: usize, shard: usize) -> Range<usize> {
    let servers = servers.max(1) as u128;
    let at = |i: u128| ((i.min(servers) * len as u128) / servers) as usize;
    at(shard as u128)..at(shard as u128 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optimizer_state_is_checked_against_the_units_and_counts_in_the_digest() {
        let layout = || {
            ModelLayout::new(vec![
                UnitSpec::constant("a", 3, 1.0),
                UnitSpec::constant("b", 2, 1.0),
            ])
            .unwrap()
        };
        let state = |b_len: usize, steps: u64| {
            vec![
                UnitOptimizerInit {
                    steps,
                    buffers: vec![("exp_avg".into(), vec![0.5; 3].into())],
                },
                UnitOptimizerInit {
                    steps,
                    buffers: vec![("exp_avg".into(), vec![0.5; b_len].into())],
                },
            ]
        };
        let err = layout().with_optimizer_state(state(3, 1)).unwrap_err();
        assert!(err.to_string().contains("unit 1 (b)"), "{err}");
        assert!(layout()
            .with_optimizer_state(state(2, 1)[..1].to_vec())
            .is_err());
        let resumed = layout().with_optimizer_state(state(2, 1)).unwrap();
        assert_eq!(resumed.optimizer_init(1).unwrap().steps, 1);
        assert!(layout().optimizer_init(0).is_none());
        let other = layout().with_optimizer_state(state(2, 2)).unwrap();
        assert_ne!(resumed.digest(), layout().digest());
        assert_ne!(resumed.digest(), other.digest());
    }

    #[test]
    fn served_units_come_last_and_count_apart_in_the_digest() {
        let a = || UnitSpec::constant("a", 3, 1.0);
        let r = || UnitSpec::constant("ref", 3, 1.0);
        let served = ModelLayout::new(vec![a(), r().served()]).unwrap();
        assert_eq!(served.model_units(), 1);
        assert!(!served.units()[1].trainable);
        let frozen = ModelLayout::new(vec![a(), r().frozen()]).unwrap();
        assert_eq!(frozen.model_units(), 2);
        assert_ne!(served.digest(), frozen.digest());
        let err = ModelLayout::new(vec![r().served(), a()]).unwrap_err();
        assert!(
            err.to_string().contains("unit a comes after a served unit"),
            "{err}"
        );
    }

    #[test]
    fn frozen_units_count_apart_in_the_digest_and_drop_optimizer_state() {
        let units = |frozen: bool| {
            let base = UnitSpec::constant("base", 6, 1.0);
            vec![
                if frozen { base.frozen() } else { base },
                UnitSpec::constant("adapter", 2, 0.0),
            ]
        };
        let trainable = ModelLayout::new(units(false)).unwrap();
        let frozen = ModelLayout::new(units(true)).unwrap();
        assert!(trainable.units().iter().all(|u| u.trainable));
        assert!(!frozen.units()[0].trainable && frozen.units()[1].trainable);
        assert_ne!(trainable.digest(), frozen.digest());
        assert_eq!(
            (frozen.trainable_elements(), frozen.frozen_elements()),
            (2, 6)
        );
        assert_eq!(trainable.frozen_elements(), 0);
        // A frozen unit's optimizer state, even of another length, is dropped: it has none.
        let resumed = frozen
            .with_optimizer_state(vec![
                UnitOptimizerInit {
                    steps: 4,
                    buffers: vec![("exp_avg".into(), vec![0.5; 3].into())],
                },
                UnitOptimizerInit {
                    steps: 4,
                    buffers: vec![("exp_avg".into(), vec![0.5; 2].into())],
                },
            ])
            .unwrap();
        let fresh = resumed.optimizer_init(0).unwrap();
        assert_eq!((fresh.steps, fresh.buffers.len()), (0, 0));
        assert_eq!(resumed.optimizer_init(1).unwrap().steps, 4);
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shards_cover_unit_exactly_once(len in 1usize..10_000, servers in 1usize..17) {
            let mut next = 0;
            for s in 0..servers {
                let r = shard_range(len, servers, s);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() <= len / servers + 1);
                prop_assert!(r.len() >= len / servers);
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }
    }

    #[test]
    fn layout_rejects_bad_units() {
        assert!(matches!(
            ModelLayout::new(vec![]),
            Err(LayoutError::Invalid(_))
        ));
        let empty = UnitSpec::constant("a", 0, 0.0);
        assert!(matches!(
            ModelLayout::new(vec![empty]),
            Err(LayoutError::Invalid(_))
        ));
        let dup = vec![
            UnitSpec::constant("a", 1, 0.0),
            UnitSpec::constant("a", 2, 0.0),
        ];
        assert!(matches!(
            ModelLayout::new(dup),
            Err(LayoutError::Invalid(_))
        ));
        let mut bad = UnitSpec::with_values("a", vec![1.0, 2.0]);
        bad.len = 3;
        assert!(matches!(
            ModelLayout::new(vec![bad]),
            Err(LayoutError::Invalid(_))
        ));
    }

    #[test]
    fn unknown_unit_is_a_typed_error() {
        let l = ModelLayout::new(vec![UnitSpec::constant("a", 4, 1.0)]).unwrap();
        assert!(matches!(
            l.unit(3),
            Err(LayoutError::UnknownUnit { unit: 3, units: 1 })
        ));
        assert_eq!(l.find("a"), Some(0));
        assert_eq!(l.unit(0).unwrap().init.slice(1..3).unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn slice_init_reads_only_the_range_asked_for() {
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = asked.clone();
        let init = UnitInit::Slice(Arc::new(move |r: Range<usize>| {
            log.lock().unwrap().push(r.clone());
            if r.end > 10 {
                return Err("past the unit".to_string());
            }
            Ok(r.map(|i| i as f32 * 0.5).collect())
        }));
        let unit = UnitSpec {
            name: "mapped".into(),
            len: 10,
            init,
            trainable: true,
            served: false,
        };
        let layout = ModelLayout::new(vec![unit]).unwrap();
        let spec = layout.unit(0).unwrap();
        assert_eq!(
            spec.init.slice(shard_range(10, 3, 1)).unwrap(),
            vec![1.5, 2.0, 2.5]
        );
        assert_eq!(spec.init.slice(6..10).unwrap(), vec![3.0, 3.5, 4.0, 4.5]);
        assert_eq!(*asked.lock().unwrap(), vec![3..6, 6..10]);
        // A read that fails is an error naming the range, never a panic.
        let err = spec.init.slice(8..12).unwrap_err().to_string();
        assert!(
            err.contains("8..12") && err.contains("past the unit"),
            "{err}"
        );
        assert_eq!(format!("{:?}", spec.init), "Slice");
        // Counted by its place, as `Fn` is, not by its values.
        let fn_init = UnitSpec {
            name: "mapped".into(),
            len: 10,
            init: UnitInit::Fn(Arc::new(|i| i as f32)),
            trainable: true,
            served: false,
        };
        assert_ne!(
            layout.digest(),
            ModelLayout::new(vec![fn_init]).unwrap().digest()
        );
    }
}
