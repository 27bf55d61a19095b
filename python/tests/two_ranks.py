"""One rank of a two-process job, started by test_trainer.py with torchrun's variables."""

import sys

import numpy as np
from test_trainer import MINIBATCHES, UNIT, loss_and_grad

import odc

with odc.init(
    {"w": np.zeros(UNIT, dtype=np.float32)}, optimizer="sgd", lr=0.01, token_budget=16
) as rt:
    computed = 0
    for lengths in MINIBATCHES:
        for mb in rt.step(lengths):
            w = mb.gather("w")
            loss, grad = loss_and_grad(w, mb.samples, lengths)
            mb.push("w", grad)
            mb.finish(loss)
            computed += 1
    print(f"rank {rt.rank} computed {computed} micro-batches", flush=True)
    if rt.rank == 0:
        np.save(sys.argv[1], rt.parameters()["w"])
