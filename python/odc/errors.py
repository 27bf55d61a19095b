"""odc's exceptions: one hierarchy, whether an error starts in Rust or in Python.

Every failure of odc is an :class:`Error`; its message names what was wrong. A bad argument is an
:class:`InvalidArgument`, which is also a :class:`ValueError`, so code that catches Python's own
keeps working.
"""


class Error(Exception):
    """Every failure of odc; its message names what was wrong."""


class InvalidArgument(Error, ValueError):
    """An argument odc does not take: a dispatch word, a cost table, a length that is no count."""


class BalanceError(Error):
    """The minibatch cannot be planned: no sample, no rank, a sample over the token budget that
    cannot be split within it, a cost model out of range."""


__all__ = ["BalanceError", "Error", "InvalidArgument"]
