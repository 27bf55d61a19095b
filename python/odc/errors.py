"""odc's exceptions: one hierarchy, whether an error starts in Rust or in Python.

Every failure of odc is an :class:`Error`; its message names what was wrong. A bad argument is an
:class:`InvalidArgument`, which is also a :class:`ValueError`, and a unit the job does not have an
:class:`UnknownUnit`, also a :class:`KeyError`, so code that catches Python's own keeps working.
"""


class Error(Exception):
    """Every failure of odc; its message names what was wrong."""


class InvalidArgument(Error, ValueError):
    """An argument odc does not take: a dispatch word, a cost table, a length that is no count,
    a tensor of the wrong dtype, device or shape."""


class UnknownUnit(Error, KeyError):
    """A unit name or index the job does not have."""

    def __str__(self):  # KeyError quotes its argument; the message is already a sentence
        return str(self.args[0]) if self.args else ""


class BalanceError(Error):
    """The minibatch cannot be planned: no sample, no rank, a sample over the token budget that
    cannot be split within it, a cost model out of range."""


class Closed(Error):
    """A call on a closed runtime, or on a micro-batch that is finished."""


class StepError(Error):
    """A step failed: a rank lost, a deadline passed, a micro-batch failed, a non-finite
    gradient; the message names the rank, micro-batch or unit."""


class CheckpointError(Error):
    """A checkpoint that cannot be written, found or opened: the message names its directory and
    what was wrong (a missing or partial step, a changed model, a failed write)."""


__all__ = [
    "BalanceError",
    "CheckpointError",
    "Closed",
    "Error",
    "InvalidArgument",
    "StepError",
    "UnknownUnit",
]
