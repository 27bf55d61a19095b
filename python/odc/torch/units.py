"""Which odc unit holds each parameter of a model wrapped by :func:`odc.torch.shard`.

Each wrapped module (a decoder block, say) is one unit, and the model itself is the root unit,
which holds every parameter no wrapped module does (embeddings, final norm, head), as FSDP2's
``fully_shard(model)`` does after ``fully_shard(block)`` for each block.

Invariants (``tests/test_torch.py``):
- Every parameter is in exactly one unit, once, however many modules share it.
- A parameter shared by modules of two units (tied embeddings) is in the unit of their nearest
  common wrapped ancestor, which is gathered whenever either of them runs (the root, for an
  embedding tied to the head).
- A unit's frozen parameters (``requires_grad=False``) form a unit of their own, ``<name>.frozen``,
  which is pulled and never pushed, as odc's LoRA trains its adapters over frozen weights.
- Units are named by their module's qualified name (``model.layers.0``); the root is ``root``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument

ROOT = "root"


@dataclass
class Unit:
    """One odc unit: its name, the module whose hooks gather it, its parameters in order."""

    name: str
    module: Any
    params: list[tuple[str, Any]] = field(default_factory=list)
    frozen: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def _owner(name: str, wrapped: list[str]) -> str:
    """The deepest wrapped module whose qualified name contains the parameter ``name``."""
    best = ""
    for prefix in wrapped:
        if prefix and name.startswith(prefix + ".") and len(prefix) > len(best):
            best = prefix
    return best


def _common(owners: list[str]) -> str:
    """The nearest wrapped module holding every one of ``owners`` (qualified names; "" the root)."""
    parts = [o.split(".") if o else [] for o in owners]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def assign(model: Any, modules: list[Any]) -> list[Unit]:
    """The units of ``model`` with ``modules`` wrapped: the root first, then the modules in order,
    each split into its trainable and its frozen part where it has both."""
    names = {id(m): n for n, m in model.named_modules()}
    wrapped: list[str] = []
    for m in modules:
        if id(m) not in names:
            raise InvalidArgument(f"{type(m).__name__} is not a submodule of the model")
        if m is model:
            continue
        if names[id(m)] in wrapped:
            raise InvalidArgument(f"module {names[id(m)]!r} is wrapped twice")
        wrapped.append(names[id(m)])
    by_name = {n: m for n, m in model.named_modules()}
    owners: dict[int, list[str]] = {}
    first: dict[int, tuple[str, Any]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(_owner(name, wrapped))
        first.setdefault(id(p), (name, p))
    groups: dict[str, list[tuple[str, Any]]] = {"": []}
    groups.update({w: [] for w in wrapped})
    for key, (name, p) in first.items():
        home = _common(owners[key])
        # The common prefix of two wrapped names need not be wrapped itself: climb to one that is.
        while home and home not in groups:
            home = home.rpartition(".")[0]
        groups[home].append((name, p))
    units = []
    for prefix, params in groups.items():
        module = by_name[prefix] if prefix else model
        units.extend(_split(prefix or ROOT, module, params))
    return units


def _split(name: str, module: Any, params: list[tuple[str, Any]]) -> list[Unit]:
    """A module's unit, or two: its trainable parameters and its frozen ones."""
    if not params:
        return []  # a module whose parameters another unit holds (or that has none)
    trainable = [(n, p) for n, p in params if p.requires_grad]
    frozen = [(n, p) for n, p in params if not p.requires_grad]
    if not frozen:
        return [Unit(name, module, trainable)]
    if not trainable:
        return [Unit(name, module, frozen, frozen=True)]
    return [Unit(name, module, trainable), Unit(f"{name}.frozen", module, frozen, frozen=True)]
