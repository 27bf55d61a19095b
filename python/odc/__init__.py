"""odc: on-demand communication for imbalanced LLM post-training, from Python.

odc's Rust runtime pulls parameters on demand and pushes gradients asynchronously, with one
barrier per minibatch and a planner that balances variable-length samples. This package exposes
it piece by piece; today: :func:`balance`, the planner, for any data loader.
"""

from ._odc import __version__
from .balance import CostModel, MicroBatch, Piece, Plan, balance
from .errors import BalanceError, Error, InvalidArgument

__all__ = [
    "BalanceError",
    "CostModel",
    "Error",
    "InvalidArgument",
    "MicroBatch",
    "Piece",
    "Plan",
    "__version__",
    "balance",
]
