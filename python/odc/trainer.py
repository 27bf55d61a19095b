"""The trainer API: this rank's part of an odc job, driven from your own loop.

``odc.init`` starts this rank's shard server and trainer (one process per rank under torchrun,
Slurm or ``odc launch``, read from their variables; alone, the trainers and servers asked for in
one process). Each step hands this rank its micro-batches; for each, ``gather`` a unit (a view of
odc's buffer, no copy), compute, ``push`` its gradient, ``finish`` with the summed loss. The
optimizer runs at the shard servers after the step's one barrier.

Gathered units and parameters are torch tensors where ``init`` was given torch tensors, numpy
arrays otherwise. With ``device="cuda"`` (the GPU path) the shard servers hold the units on the
GPU, a gathered unit is a CUDA tensor viewing odc's device memory, and a CUDA gradient is pushed
from where autograd wrote it: no byte crosses host memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from . import _odc
from .errors import InvalidArgument


class _Shapes:
    """The units' shapes as given to ``init``, and whether they came as torch tensors."""

    def __init__(self, units: Mapping[str, Any]):
        self.shapes = {name: tuple(int(n) for n in t.shape) for name, t in units.items()}
        self.torch = any(type(t).__module__.startswith("torch") for t in units.values())

    def array(self, buffer: _odc.Buffer, unit: str | int) -> Any:
        """A view of odc's buffer with the unit's shape: a torch tensor, or a numpy array."""
        names = list(self.shapes)
        name = names[unit] if isinstance(unit, int) and 0 <= unit < len(names) else unit
        shape = self.shapes.get(name, (-1,))
        if self.torch:
            import torch

            return torch.from_dlpack(buffer).view(shape)
        import numpy

        return numpy.from_dlpack(buffer).reshape(shape)


def _detached(tensor: Any) -> Any:
    """A torch tensor without autograd's history (DLPack refuses one that requires grad)."""
    detach = getattr(tensor, "detach", None)
    return detach() if callable(detach) else tensor


def _is_cuda(tensor: Any) -> bool:
    return bool(getattr(tensor, "is_cuda", False))


def _on_host(tensor: Any) -> Any:
    """An initial value in host memory, where odc reads it once (a CUDA tensor is copied)."""
    tensor = _detached(tensor)
    return tensor.cpu() if _is_cuda(tensor) else tensor


def _ints(values: Sequence[int]) -> list[int]:
    """A list of ints from a list, tuple, numpy array or torch tensor."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(n) for n in values]


class MicroBatch:
    """One micro-batch of this rank: ``samples`` (indices into the step's lengths), ``tokens``.

    Dropped without ``finish``, it fails, and the step replays it or fails naming it.
    """

    def __init__(self, turn: _odc.MicroBatchTurn, shapes: _Shapes):
        self._turn = turn
        self._shapes = shapes
        self.samples: list[int] = turn.samples
        self.tokens: int = turn.tokens
        self.step: int = turn.step
        self.id: int = turn.id
        self.on_device: bool = turn.on_device

    def gather(self, unit: str | int) -> Any:
        """The unit's parameters for this micro-batch, shaped as given to ``init``: a view of
        odc's buffer (no copy), valid as long as you hold it. Writing to it writes odc's copy."""
        return self._shapes.array(self._turn.gather(unit), unit)

    def push(self, unit: str | int, grad: Any) -> None:
        """Sends ``grad`` (fp32 or bf16, the unit's element count), the gradient of this
        micro-batch's summed loss with respect to the unit: on the CPU, or on the GPU path a CUDA
        tensor on the runtime's device (a bf16 one is sent as fp32)."""
        grad = _detached(grad)
        if self.on_device and _is_cuda(grad):
            grad = grad.float()  # the same tensor when it is fp32 already
        self._turn.push(unit, grad)

    def release(self, unit: str | int) -> None:
        """Lets odc free the trainer's copy of a gathered unit (views you hold stay valid)."""
        self._turn.release(unit)

    def finish(self, loss_sum: float) -> None:
        """Ends the micro-batch with its summed loss (not its mean)."""
        self._turn.finish(float(loss_sum))

    def fail(self, reason: str) -> None:
        """Ends the micro-batch as failed."""
        self._turn.fail(str(reason))

    def __repr__(self) -> str:
        return repr(self._turn)


class Step:
    """One step: iterate it for this rank's micro-batches; ``stats`` once it has ended."""

    def __init__(self, step: _odc.Step, shapes: _Shapes):
        self._step = step
        self._shapes = shapes

    def __iter__(self) -> Iterator[MicroBatch]:
        for turn in self._step:
            yield MicroBatch(turn, self._shapes)

    @property
    def stats(self) -> dict[str, Any] | None:
        """loss (the minibatch's mean), tokens, samples, micro_batches, grad_norm, replays,
        wall_s; ``None`` until the step has ended."""
        return self._step.stats


class Resumed(NamedTuple):
    """The checkpoint a job resumed from: its ``step-<N>`` directory, ``N`` (the job's next
    step), and the ``extra`` saved with it."""

    path: str
    step: int
    extra: Any


class Runtime:
    """This rank's part of an odc job (see :func:`init`)."""

    def __init__(
        self,
        units: Mapping[str, Any],
        *,
        tensors: Mapping[str, Sequence[tuple[str, Sequence[int]]]] | None = None,
        **options: Any,
    ):
        if not isinstance(units, Mapping) or not units:
            raise InvalidArgument("units must be a non-empty mapping of names to tensors")
        self._shapes = _Shapes(units)
        if tensors is not None:
            unknown = set(tensors) - set(units)
            if unknown:
                raise InvalidArgument(f"tensors names units that are not units: {sorted(unknown)}")
            flat = {u: [(u, [math.prod(shape)])] for u, shape in self._shapes.shapes.items()}
            options["tensors"] = [
                [(str(n), [int(d) for d in shape]) for n, shape in tensors.get(u, flat[u])]
                for u in units
            ]
        self._rt = _odc.Runtime([(n, _on_host(t)) for n, t in units.items()], **options)

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def world_size(self) -> int:
        return self._rt.world_size

    @property
    def units(self) -> list[str]:
        return self._rt.units

    @property
    def host_bytes(self) -> int:
        """Bytes this rank's gathers and pushes moved through host memory (0 on the GPU path)."""
        return self._rt.host_bytes

    @property
    def device(self) -> str:
        """Where this rank computes: ``"cpu"``, or ``"cuda:N"`` on the GPU path."""
        return self._rt.device

    def step(self, lengths: Sequence[int], loss_tokens: Sequence[int] | None = None) -> Step:
        """Starts a step on a minibatch of samples with ``lengths`` tokens (every rank calls it;
        rank 0's lengths are planned): iterate the result for this rank's micro-batches.

        The servers divide the summed gradient by the minibatch's loss tokens: each sample's
        ``loss_tokens`` (the tokens its loss sums over, such as an answer's under SFT's masking),
        all of its tokens unless given.
        """
        loss = None if loss_tokens is None else _ints(loss_tokens)
        return Step(self._rt.step(_ints(lengths), loss), self._shapes)

    @property
    def steps_done(self) -> int:
        """Steps the job has taken (a resumed job counts its checkpoint's)."""
        return self._rt.steps_done

    @property
    def resumed(self) -> Resumed | None:
        """The checkpoint this job resumed from, or ``None``."""
        r = self._rt.resumed
        return None if r is None else Resumed(r[0], r[1], json.loads(r[2]))

    def save_checkpoint(self, extra: Any = None) -> str | None:
        """Writes the job's state (every shard's fp32 masters and optimizer state) at its current
        step into ``checkpoint_dir/step-<N>``, with ``extra`` (anything JSON takes: a data
        loader's position, say), and returns once it is on disk. Every rank may call it; the
        lead writes, and is told the directory, the others ``None``."""
        try:
            text = json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"extra must be JSON-serializable: {e}") from None
        return self._rt.save_checkpoint(text)

    def parameters(self) -> dict[str, Any]:
        """Every unit's parameters after the last step, shaped as given (copies odc made)."""
        return {name: self._shapes.array(buf, name) for name, buf in self._rt.parameters()}

    def close(self) -> None:
        """Stops this rank's part of the job; views handed out stay valid."""
        self._rt.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(units: Mapping[str, Any], **options: Any) -> Runtime:
    """Starts this rank's part of an odc job over ``units`` (name → initial tensor, fp32 or bf16).

    Options (keyword): ``optimizer`` ("adamw" or "sgd"), ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``momentum`` (sgd), ``clip_grad_norm``, ``frozen`` (unit names that take
    no gradient), ``token_budget``, ``precision`` of the pulls ("fp32" or "bf16"), ``dispatch``
    ("static" or "dynamic"), ``trainers`` and ``servers`` (in one process, without a launcher),
    ``micro_batch_timeout`` and ``step_timeout`` in seconds. Checkpoints: ``checkpoint_dir``
    (where :meth:`Runtime.save_checkpoint` writes), ``resume`` (a ``step-<N>`` directory, or
    ``"auto"``: the newest complete one of ``checkpoint_dir``, if any), ``keep_last_checkpoints``
    (0: all), ``tensors`` (each unit's (name, shape) list, the names a checkpoint holds; one flat
    tensor per unit, named after it, unless given). ``device``: ``"cpu"`` (the default), or
    ``"cuda"`` / ``"cuda:N"`` for the GPU path (the shard servers and transfers on the GPU, over
    odc's cuda transport; under a launcher each rank's device is its local rank's, as
    ``torch.cuda.set_device(local_rank)`` picks). ``direct_pushes``: push every gradient
    straight to its owner; by default a job whose ranks span hosts of at least 2 (torchrun's
    ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``) relays each host's pushes through its own shard
    servers, so they cross the network once per step.
    """
    return Runtime(units, **options)


__all__ = ["MicroBatch", "Resumed", "Runtime", "Step", "init"]
