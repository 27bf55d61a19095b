"""One rank of a job of two (or more) processes, started by test_trainer.py with torchrun's
variables: ``two_ranks.py PARAMS.npy [direct]`` (``direct``: ``direct_pushes=True``)."""

import sys

import numpy as np
from test_trainer import MINIBATCHES, UNIT, loss_and_grad

import odc

direct = sys.argv[2:] == ["direct"]
with odc.init(
    {"w": np.zeros(UNIT, dtype=np.float32)},
    optimizer="sgd",
    lr=0.01,
    token_budget=16,
    direct_pushes=direct,
) as rt:
    computed, early = 0, 0
    for lengths in MINIBATCHES:
        step = rt.step(lengths)
        for mb in step:
            w = mb.gather("w")
            loss, grad = loss_and_grad(w, mb.samples, lengths)
            mb.push("w", grad)
            mb.finish(loss)
            computed += 1
        early += step.stats["early_relay_flushes"]
    print(f"rank {rt.rank} computed {computed} micro-batches", flush=True)
    print(f"rank {rt.rank} early relay flushes {early}", flush=True)
    if rt.rank == 0:
        np.save(sys.argv[1], rt.parameters()["w"])
