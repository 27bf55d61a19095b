//! `odc.balance`, `odc.CostModel`, `odc.Plan`, `odc.MicroBatch`: [`crate::plan`] for Python,
//! types mapped one to one.

use odc_policy::balancer::CostModel;
use pyo3::prelude::*;

use crate::errors;
use crate::plan::{self, Balanced, Dispatch, Piece, Split};

/// The estimated cost of a sample of `s` tokens, `a·ŝ² + b·ŝ` with `ŝ = s / scale` (attention
/// the quadratic term, the rest of the transformer the linear one), and `transfer`, what one
/// micro-batch's pulls and pushes take. Only ratios matter to the balancer.
#[pyclass(frozen, name = "CostModel", module = "odc")]
#[derive(Clone, Copy)]
pub(crate) struct PyCostModel(CostModel);

#[pymethods]
impl PyCostModel {
    #[new]
    #[pyo3(signature = (a, b, scale = 32_000.0, transfer = 0.0))]
    fn new(a: f64, b: f64, scale: f64, transfer: f64) -> PyResult<Self> {
        let model = CostModel {
            a,
            b,
            scale,
            transfer,
        };
        model.validate().map_err(errors::balance)?;
        Ok(Self(model))
    }

    /// Cost proportional to length (`a = 0`, `b = 1`).
    #[staticmethod]
    fn linear() -> Self {
        Self(CostModel::linear())
    }

    /// ODC's model fitted on a 7B model (the runtime's default).
    #[staticmethod]
    fn odc_7b() -> Self {
        Self(CostModel::odc_7b())
    }

    /// The model closest to a measured table (`costs[i]` of a sample of `lengths[i]` tokens) in
    /// least squares, with `a, b ≥ 0`.
    #[staticmethod]
    #[pyo3(signature = (lengths, costs, scale = 32_000.0))]
    fn fit(lengths: Vec<u64>, costs: Vec<f64>, scale: f64) -> PyResult<Self> {
        plan::fit(&lengths, &costs, scale)
            .map(Self)
            .map_err(errors::invalid)
    }

    /// The estimated cost of one sample of `tokens` tokens.
    fn cost(&self, tokens: u64) -> f64 {
        self.0.cost(tokens)
    }

    #[getter]
    fn a(&self) -> f64 {
        self.0.a
    }

    #[getter]
    fn b(&self) -> f64 {
        self.0.b
    }

    #[getter]
    fn scale(&self) -> f64 {
        self.0.scale
    }

    #[getter]
    fn transfer(&self) -> f64 {
        self.0.transfer
    }

    fn __repr__(&self) -> String {
        let m = &self.0;
        format!(
            "CostModel(a={}, b={}, scale={}, transfer={})",
            m.a, m.b, m.scale, m.transfer
        )
    }
}

/// One member's piece of a split sample: the sample, this member of its gang, every member's
/// rank (the ring's order), and the two token ranges of the sample it holds (zig-zag halves).
#[pyclass(frozen, name = "Piece", module = "odc")]
#[derive(Clone)]
pub(crate) struct PyPiece {
    #[pyo3(get)]
    sample: usize,
    #[pyo3(get)]
    member: u32,
    #[pyo3(get)]
    ranks: Vec<u32>,
    #[pyo3(get)]
    chunks: Vec<(u64, u64)>,
}

#[pymethods]
impl PyPiece {
    fn __repr__(&self) -> String {
        format!(
            "Piece(sample={}, member={}, ranks={:?}, chunks={:?})",
            self.sample, self.member, self.ranks, self.chunks
        )
    }
}

impl From<&Piece> for PyPiece {
    fn from(p: &Piece) -> Self {
        PyPiece {
            sample: p.sample,
            member: p.member,
            ranks: p.ranks.clone(),
            chunks: p.chunks.iter().map(|r| (r.start, r.end)).collect(),
        }
    }
}

/// One micro-batch: the indices of its whole samples (into the minibatch, longest first), or, for
/// one member's piece of a split sample, none and its `piece`; its tokens and estimated cost.
#[pyclass(frozen, name = "MicroBatch", module = "odc")]
pub(crate) struct PyMicroBatch {
    #[pyo3(get)]
    samples: Vec<usize>,
    #[pyo3(get)]
    piece: Option<PyPiece>,
    #[pyo3(get)]
    tokens: u64,
    #[pyo3(get)]
    cost: f64,
}

#[pymethods]
impl PyMicroBatch {
    fn __repr__(&self) -> String {
        let what = match &self.piece {
            Some(p) => format!("piece={}", p.__repr__()),
            None => format!("samples={:?}", self.samples),
        };
        format!(
            "MicroBatch({what}, tokens={}, cost={:.4})",
            self.tokens, self.cost
        )
    }
}

/// A minibatch's plan: every micro-batch (by cost, descending) and each rank's list of them.
#[pyclass(frozen, name = "Plan", module = "odc")]
pub(crate) struct PyPlan {
    planned: Balanced,
}

#[pymethods]
impl PyPlan {
    /// Every micro-batch of the minibatch: by estimated cost, descending, or, split, the pieces
    /// first.
    #[getter]
    fn micro_batches(&self) -> Vec<PyMicroBatch> {
        let Balanced { plan, pieces } = &self.planned;
        plan.micro_batches
            .iter()
            .zip(pieces)
            .map(|(mb, piece)| PyMicroBatch {
                samples: mb.samples.clone(),
                piece: piece.as_ref().map(PyPiece::from),
                tokens: mb.tokens,
                cost: mb.cost,
            })
            .collect()
    }

    /// Every piece of a split sample, in micro-batch order (empty where nothing is split).
    #[getter]
    fn pieces(&self) -> Vec<PyPiece> {
        self.planned
            .pieces
            .iter()
            .flatten()
            .map(PyPiece::from)
            .collect()
    }

    /// For each rank, the indices of its micro-batches (into `micro_batches`), costliest first.
    #[getter]
    fn ranks(&self) -> Vec<Vec<usize>> {
        self.planned.plan.per_trainer.clone()
    }

    /// For each rank, its micro-batches as lists of whole samples' indices: what a data loader
    /// yields (a piece of a split sample is an empty list here; `micro_batches` names it).
    fn samples(&self) -> Vec<Vec<Vec<usize>>> {
        let plan = &self.planned.plan;
        let mbs = &plan.micro_batches;
        plan.per_trainer
            .iter()
            .map(|list| list.iter().map(|&i| mbs[i].samples.clone()).collect())
            .collect()
    }

    /// Each rank's estimated cost (the sum of its micro-batches').
    fn rank_costs(&self) -> Vec<f64> {
        self.planned.plan.trainer_costs()
    }

    fn __repr__(&self) -> String {
        let Balanced { plan, pieces } = &self.planned;
        let most = plan.trainer_costs().into_iter().fold(0.0, f64::max);
        let split = pieces.iter().flatten().filter(|p| p.member == 0).count();
        format!(
            "Plan({} micro-batches over {} ranks, {split} samples split, largest rank cost \
             {most:.4})",
            plan.micro_batches.len(),
            plan.per_trainer.len()
        )
    }
}

/// The plan of a minibatch whose samples have `lengths` tokens over `ranks` ranks, micro-batches
/// of at most `token_budget` tokens, priced by `cost` (default: the runtime's, `CostModel.odc_7b()`),
/// dispatched `"static"` (LB-Mini), `"dynamic"` (decreasing sizes, for a work queue) or
/// `"equal"` (LB-Micro: the same count on every rank, for collectives); with `split`, samples of
/// at least `min_split_tokens` cut over gangs of at most `max_gang` ranks (0: any) where that
/// shortens the step.
#[pyfunction]
#[pyo3(signature = (
    lengths, ranks, token_budget, cost = None, dispatch = "static", split = false,
    min_split_tokens = 0, max_gang = 0,
))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, each with its default
fn balance(
    py: Python<'_>,
    lengths: Vec<u64>,
    ranks: usize,
    token_budget: u64,
    cost: Option<PyRef<'_, PyCostModel>>,
    dispatch: &str,
    split: bool,
    min_split_tokens: u64,
    max_gang: u32,
) -> PyResult<PyPlan> {
    let dispatch: Dispatch = dispatch.parse().map_err(errors::invalid)?;
    let cost = cost.map_or_else(CostModel::default, |c| c.0);
    let split = split.then_some(Split {
        min_tokens: min_split_tokens,
        max_gang,
    });
    let planned = py
        .detach(|| plan::plan(&lengths, ranks, token_budget, &cost, dispatch, split))
        .map_err(errors::plan)?;
    Ok(PyPlan { planned })
}

/// Adds the balancer's function and types to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(balance, m)?)?;
    m.add_class::<PyCostModel>()?;
    m.add_class::<PyMicroBatch>()?;
    m.add_class::<PyPiece>()?;
    m.add_class::<PyPlan>()?;
    Ok(())
}
