"""``odc.torch.shard``: a PyTorch model trained through odc's runtime, as FSDP2's ``fully_shard``
trains it through collectives.

Each wrapped module is an odc unit (:mod:`odc.torch.units`). The model's parameters keep their
objects, names, dtypes and devices; between uses their storage is freed (resized to 0 bytes, as
FSDP2 frees its unsharded parameters). Within a micro-batch:

- **Before a module's forward** its unit is gathered from the shard servers and copied into the
  parameters' storage (one copy, as FSDP2 copies out of its all-gather buffer); odc's copy is
  released at once.
- **After its forward** the storage is freed again (``reshard_after_forward``; never for the
  root, which the backward needs first).
- **Before its backward** (a hook on the forward's outputs) the unit is gathered again.
- **As autograd produces the unit's last gradient** (PyTorch's post-accumulate-grad hooks) the
  unit's gradient is pushed to its owners, asynchronously, and the parameters' ``.grad`` dropped;
  after the module's backward (an autograd function on its inputs, as FSDP2's post-backward) the
  storage is freed, and a gradient only partly produced is pushed with zeros for the rest.
- **At ``finish``** whatever is still gathered or unpushed is pushed and freed, then the
  micro-batch ends with its summed loss. The optimizer runs at the servers after the step's one
  barrier; ranks may run different numbers of micro-batches.

PyTorch's own hooks only, no FSDP internals: the same code serves torch 2.4 to 2.15. (FSDP2's
``set_custom_all_gather`` keeps FSDP2's lockstep collective schedule and its sharded layout; odc's
pulls are one rank's alone, which is what lets micro-batch counts differ.)

Invariants (``tests/test_torch.py``): outside ``with mb:`` a wrapped model's forward raises
``odc.InvalidArgument``; each micro-batch pushes each trainable unit it used exactly once; a
parameter's storage holds the micro-batch's values whenever autograd reads it, including under
activation checkpointing (a recomputed forward in the backward finds its unit gathered).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import trainer
from ..errors import Closed, InvalidArgument
from .units import ROOT, Unit, assign


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs after the module's (FSDP2's pattern)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


class _Held:
    """One unit in the model: the storage its parameters view, and its state this micro-batch."""

    def __init__(self, unit: Unit):
        self.unit = unit
        params = [p for _, p in unit.params]
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise InvalidArgument(
                f"unit {unit.name!r} mixes dtypes {sorted(map(str, dtypes))} or devices "
                f"{sorted(map(str, devices))}: one unit needs one of each (convert the model first)"
            )
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self.initial = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
        self.flat = torch.empty(unit.numel, dtype=self.dtype, device=self.device)
        self.nbytes = self.flat.untyped_storage().nbytes()
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.flat[offset : offset + n].view(p.shape)
            offset += n
        self.params = params
        self.waiting: set[int] = set()
        self.gathered = False
        self.pushed = False
        self.backward = False
        self.free()

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def fill(self, values: torch.Tensor) -> None:
        """Allocates the storage again and copies ``values`` (the unit, flat) into it."""
        if not self.gathered:
            self.flat.untyped_storage().resize_(self.nbytes)
            self.gathered = True
        with torch.no_grad():
            self.flat.copy_(values.view(-1))

    def begin(self) -> None:
        self.waiting = {id(p) for p in self.params if not self.unit.frozen}
        self.pushed = False
        self.backward = False

    def gradient(self) -> torch.Tensor | None:
        """The unit's gradient, flat (zeros where a parameter got none); ``None`` if none did."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return None
        flat = [
            (g if g is not None else torch.zeros_like(p)).reshape(-1)
            for p, g in zip(self.params, grads)
        ]
        grad = torch.cat(flat)
        if grad.dtype not in (torch.float32, torch.bfloat16):
            grad = grad.float()
        for p in self.params:
            p.grad = None
        return grad


class ShardedModel:
    """A model whose wrapped modules odc gathers, and whose gradients odc pushes (see
    :func:`shard`). Iterate :meth:`step` for this rank's micro-batches."""

    def __init__(
        self,
        model: torch.nn.Module,
        modules: Sequence[torch.nn.Module] | None = None,
        *,
        reshard_after_forward: bool = True,
        **options: Any,
    ):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"shard wraps a torch.nn.Module, not {type(model).__name__}")
        self.model = model
        units = assign(model, list(modules or []))
        if not units:
            raise InvalidArgument("the model has no parameters")
        self._held = {u.name: _Held(u) for u in units}
        self._reshard = reshard_after_forward
        self._mb: trainer.MicroBatch | None = None
        self._full = False
        frozen = [u.name for u in units if u.frozen]
        values = {name: h.initial for name, h in self._held.items()}
        # A checkpoint names the model's own parameters (their names and shapes).
        names = {
            name: [(n, tuple(p.shape)) for n, p in h.unit.params] for name, h in self._held.items()
        }
        try:
            self.runtime = trainer.init(values, frozen=frozen, tensors=names, **options)
        except BaseException:
            for h in self._held.values():  # the model as it was, for the caller to use
                h.fill(h.initial)
            raise
        for h in self._held.values():
            h.initial = None
        self._owner = {id(p): h for h in self._held.values() for p in h.params}
        self._handles = self._hook(units)

    # -- hooks ---------------------------------------------------------------------------

    def _hook(self, units: list[Unit]) -> list[Any]:
        by_module: dict[int, list[_Held]] = {}
        modules: dict[int, torch.nn.Module] = {}
        for u in units:
            by_module.setdefault(id(u.module), []).append(self._held[u.name])
            modules[id(u.module)] = u.module
        handles = []
        for key, held in by_module.items():
            module = modules[key]
            root = module is self.model
            handles.append(
                module.register_forward_pre_hook(self._pre_forward(held), with_kwargs=True)
            )
            handles.append(module.register_forward_hook(self._post_forward(held, root)))
        for h in self._held.values():
            if not h.unit.frozen:
                for p in h.params:
                    handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return handles

    def _pre_forward(self, held: list[_Held]) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> Any:
            if self._full:
                return None
            for h in held:
                self._gather(h)
            if not torch.is_grad_enabled():
                return None
            args, kwargs = self._after_backward(held, args, kwargs)
            return args, kwargs

        return hook

    def _after_backward(self, held: list[_Held], args: tuple, kwargs: dict) -> tuple:
        """The module's inputs, through :class:`_PostBackward` where they need a gradient."""
        flat = list(args) + list(kwargs.values())
        slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not slots:
            return args, kwargs
        outs = _PostBackward.apply(lambda: self._post_backward(held), *[flat[i] for i in slots])
        for i, t in zip(slots, outs):
            flat[i] = t
        keys = list(kwargs)
        return tuple(flat[: len(args)]), dict(zip(keys, flat[len(args) :]))

    def _post_forward(self, held: list[_Held], root: bool) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if self._full:
                return
            if self._reshard and not root:
                for h in held:
                    if not h.backward:  # a forward recomputed in the backward keeps its unit
                        h.free()
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(held))

        return hook

    def _pre_backward(self, held: list[_Held]) -> None:
        for h in held:
            h.backward = True
            self._gather(h)

    def _post_backward(self, held: list[_Held]) -> None:
        for h in held:
            self._push(h)
            h.free()
            h.backward = False

    def _on_grad(self, param: torch.Tensor) -> None:
        h = self._owner[id(param)]
        if h.pushed:
            # Pushed already (after its module's backward): a gradient now would be lost.
            raise InvalidArgument(
                f"a gradient of unit {h.unit.name!r} came after the unit was pushed: run every "
                "use of a module before its backward, or call backward once per micro-batch"
            )
        h.waiting.discard(id(param))
        if not h.waiting:
            self._push(h)

    # -- odc -----------------------------------------------------------------------------

    def _micro_batch(self) -> trainer.MicroBatch:
        if self._mb is None:
            raise InvalidArgument(
                "the model ran outside a micro-batch: run it inside `with mb:` for a micro-batch "
                "of `step`, or inside `with sharded.full_parameters():`"
            )
        return self._mb

    def _gather(self, h: _Held) -> None:
        if h.gathered:
            return
        mb = self._micro_batch()
        name = h.unit.name
        h.fill(mb.gather(name))
        mb.release(name)  # the module's storage holds the copy now

    def _push(self, h: _Held) -> None:
        if h.unit.frozen or h.pushed:
            return
        grad = h.gradient()
        if grad is not None:
            mb = self._micro_batch()
            # Over a host transport a CUDA gradient goes through host memory; on the GPU path
            # (device="cuda") it is pushed from the device.
            mb.push(h.unit.name, grad if mb.on_device else grad.cpu())
            h.pushed = True

    # -- the user's API ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def units(self) -> dict[str, list[str]]:
        """Each unit's name and the names of its parameters, in order."""
        return {name: [n for n, _ in h.unit.params] for name, h in self._held.items()}

    def step(self, lengths: Sequence[int], loss_tokens: Sequence[int] | None = None) -> Step:
        """One step on a minibatch whose samples have ``lengths`` tokens (every rank calls it;
        rank 0's are planned; see :meth:`odc.Runtime.step` for ``loss_tokens``). Iterate it for
        this rank's micro-batches."""
        return Step(self, self.runtime.step(lengths, loss_tokens))

    @property
    def resumed(self) -> trainer.Resumed | None:
        """The checkpoint the job resumed from (``resume=`` of :func:`shard`), or ``None``."""
        return self.runtime.resumed

    @property
    def steps_done(self) -> int:
        """Steps taken, a resumed job's checkpoint's included: the next step's number."""
        return self.runtime.steps_done

    def save_checkpoint(self, extra: Any = None) -> str | None:
        """A sharded checkpoint of the parameters (named as the model names them) and AdamW's
        state, into ``checkpoint_dir/step-<N>`` (see :meth:`odc.Runtime.save_checkpoint`)."""
        return self.runtime.save_checkpoint(extra)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict after the last step, keys as ``model.state_dict()``'s:
        what ``save_pretrained`` or ``load_state_dict`` takes (FSDP2's full state dict)."""
        values = self.runtime.parameters()
        by_param: dict[int, torch.Tensor] = {}
        for name, h in self._held.items():
            flat, offset = values[name].reshape(-1), 0
            for p in h.params:
                n = p.numel()
                by_param[id(p)] = flat[offset : offset + n].view(p.shape).to(p.dtype).clone()
                offset += n
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = by_param[id(t)] if id(t) in by_param else t.detach().clone()
        return out

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[torch.nn.Module]:
        """The model with every parameter at its latest values, for evaluation or generation
        (``model.generate``) outside a step; freed again on exit."""
        if self._mb is not None:
            raise InvalidArgument("full_parameters inside a micro-batch")
        values = self.runtime.parameters()
        try:
            for name, h in self._held.items():
                h.fill(values[name].to(h.device))
            self._full = True
            yield self.model
        finally:
            self._full = False
            for h in self._held.values():
                h.free()

    def close(self) -> None:
        """Stops this rank's part of the job and removes the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.runtime.close()

    def __enter__(self) -> ShardedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MicroBatch:
    """One micro-batch of this rank: run the model on ``samples`` inside ``with mb:``, backward
    the summed loss, then ``finish(loss)``. An exception inside fails it (the step replays it or
    fails naming it)."""

    def __init__(self, sharded: ShardedModel, mb: trainer.MicroBatch):
        self._sharded = sharded
        self._mb = mb
        self.samples: list[int] = mb.samples
        self.tokens: int = mb.tokens
        self.step: int = mb.step
        self.id: int = mb.id
        self._finished = False

    def __enter__(self) -> MicroBatch:
        s = self._sharded
        if s._mb is not None:
            raise InvalidArgument("another micro-batch is running: finish it first")
        s._mb = self._mb
        for h in s._held.values():
            h.begin()
        return self

    def finish(self, loss_sum: Any) -> None:
        """Pushes what is left, frees every unit, and ends the micro-batch with its summed loss
        (a float or a one-element tensor)."""
        if self._finished:
            raise Closed(f"micro-batch {self.id} of step {self.step} is finished")
        loss = float(loss_sum.detach()) if isinstance(loss_sum, torch.Tensor) else float(loss_sum)
        s = self._sharded
        for h in s._held.values():
            s._push(h)
            h.free()
        self._mb.finish(loss)
        self._finished = True

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        s = self._sharded
        try:
            if kind is not None and not self._finished:
                self._mb.fail(f"{kind.__name__}: {error}")
            elif not self._finished:
                self._mb.fail("the micro-batch ended without finish(loss)")
                raise InvalidArgument(
                    f"micro-batch {self.id} of step {self.step} ended without finish(loss)"
                )
        finally:
            for h in s._held.values():
                h.free()
                for p in h.params:
                    p.grad = None
            s._mb = None
            self._finished = True


class Step:
    """One step of a sharded model: iterate it for this rank's micro-batches; ``stats`` after."""

    def __init__(self, sharded: ShardedModel, step: trainer.Step):
        self._sharded = sharded
        self._step = step

    def __iter__(self) -> Iterator[MicroBatch]:
        for mb in self._step:
            yield MicroBatch(self._sharded, mb)

    @property
    def stats(self) -> dict[str, Any] | None:
        return self._step.stats


def shard(
    model: torch.nn.Module,
    modules: Sequence[torch.nn.Module] | None = None,
    *,
    reshard_after_forward: bool = True,
    **options: Any,
) -> ShardedModel:
    """Trains ``model`` through odc: each of ``modules`` (a model's decoder blocks, say) is one
    unit, gathered before its forward and its backward and pushed as its gradient is produced;
    the rest of the model is the root unit (``"root"``).

    ``options`` are :func:`odc.init`'s (optimizer, lr, betas, eps, weight_decay, clip_grad_norm,
    token_budget, precision, dispatch, timeouts, and trainers/servers in one process).
    Frozen parameters (``requires_grad=False``) are pulled and never pushed.
    """
    return ShardedModel(model, modules, reshard_after_forward=reshard_after_forward, **options)


__all__ = ["ROOT", "MicroBatch", "ShardedModel", "Step", "shard"]
