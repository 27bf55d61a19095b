"""odc: on-demand communication for imbalanced LLM post-training, from Python.

odc's Rust runtime pulls parameters on demand and pushes gradients asynchronously, with one
barrier per minibatch and a planner that balances variable-length samples. This package exposes
it piece by piece: :func:`balance`, the planner, for any data loader; :func:`init`, this rank's
part of an odc job driven from your own loop.
"""

from ._odc import __version__
from .balance import CostModel, MicroBatch, Piece, Plan, balance
from .errors import (
    BalanceError,
    CheckpointError,
    Closed,
    Error,
    InvalidArgument,
    StepError,
    UnknownUnit,
)
from .trainer import Resumed, Runtime, Step, init

__all__ = [
    "BalanceError",
    "CheckpointError",
    "Closed",
    "CostModel",
    "Error",
    "InvalidArgument",
    "MicroBatch",
    "Piece",
    "Plan",
    "Resumed",
    "Runtime",
    "Step",
    "StepError",
    "UnknownUnit",
    "__version__",
    "balance",
    "init",
]
