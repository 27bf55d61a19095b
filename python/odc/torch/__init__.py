"""odc for PyTorch models: :func:`shard` trains a model through odc's runtime, as FSDP2's
``fully_shard`` trains it through collectives (PyTorch computes; odc pulls the parameters on
demand and pushes the gradients). Needs torch; ``import odc`` alone does not."""

from .shard import MicroBatch, ShardedModel, Step, shard
from .units import ROOT, Unit, assign

__all__ = ["ROOT", "MicroBatch", "ShardedModel", "Step", "Unit", "assign", "shard"]
