"""``odc.balance``: odc's minibatch planner, as the runtime runs it, with no training attached.

The lengths may be any sequence of non-negative integers: a list, a tuple, a numpy array or a
torch tensor (one dimension, integer dtype).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from . import _odc
from .errors import InvalidArgument

CostModel = _odc.CostModel
Plan = _odc.Plan
MicroBatch = _odc.MicroBatch
Piece = _odc.Piece


def _counts(lengths: Iterable[int]) -> list[int]:
    """The lengths as Python ints, each named where it is not a non-negative integer."""
    if hasattr(lengths, "tolist"):  # numpy arrays and torch tensors, without importing either
        shape = getattr(lengths, "shape", None)
        if shape is not None and len(shape) != 1:
            raise InvalidArgument(f"lengths must be one-dimensional, got shape {tuple(shape)}")
        lengths = lengths.tolist()
    out = []
    for i, length in enumerate(lengths):
        try:
            n = operator.index(length)
        except TypeError:
            raise InvalidArgument(
                f"length {i} is {length!r}: lengths are counts of tokens (integers)"
            ) from None
        if n < 0:
            raise InvalidArgument(f"length {i} is {n}: lengths are counts of tokens (>= 0)")
        out.append(n)
    return out


def balance(
    lengths: Iterable[int],
    ranks: int,
    token_budget: int,
    cost: CostModel | None = None,
    dispatch: str = "static",
    split: bool = False,
    min_split_tokens: int = 0,
    max_gang: int = 0,
) -> Plan:
    """Plans a minibatch whose samples have ``lengths`` tokens over ``ranks`` ranks.

    Args:
        lengths: tokens of each sample.
        ranks: how many ranks (data-parallel workers) share the minibatch.
        token_budget: the most tokens in one micro-batch of whole samples.
        cost: the cost model (default: ``CostModel.odc_7b()``, what the runtime uses); only
            ratios matter. ``CostModel.fit(lengths, seconds)`` makes one from a measured table.
        dispatch: ``"static"`` (ODC's LB-Mini: each rank's share balanced by cost, counts may
            differ), ``"dynamic"`` (decreasing sizes, the lists a work queue starts from) or
            ``"equal"`` (LB-Micro: the same count on every rank, what FSDP's collectives need).
        split: cut long samples over gangs of ranks where that shortens the step (zig-zag
            halves, as context parallelism cuts them); each member's piece is a micro-batch.
        min_split_tokens: samples shorter than this are never split.
        max_gang: the most ranks one sample is split over (0: any).

    Returns:
        a :class:`Plan`: ``plan.samples()[rank]`` is that rank's micro-batches as lists of sample
        indices; ``plan.micro_batches`` and ``plan.ranks`` say the rest (pieces, tokens, costs).

    Raises:
        InvalidArgument: a length that is not a count, an unknown dispatch word.
        BalanceError: no sample, no rank, a sample over the budget that cannot be split within it.
    """
    for name, value in (("ranks", ranks), ("token_budget", token_budget), ("max_gang", max_gang)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{name} must be a non-negative integer, got {value!r}")
    return _odc.balance(
        _counts(lengths),
        ranks,
        token_budget,
        cost,
        dispatch,
        split,
        operator.index(min_split_tokens),
        max_gang,
    )


__all__ = ["CostModel", "MicroBatch", "Piece", "Plan", "balance"]
