"""One rank of a two-process job whose rank 1 dies mid-step (started by test_trainer.py with
torchrun's variables): rank 0 reports what its step raised."""

import os
import sys

import numpy as np
from test_trainer import MINIBATCHES, UNIT, loss_and_grad

import odc

with odc.init(
    {"w": np.zeros(UNIT, dtype=np.float32)},
    optimizer="sgd",
    lr=0.01,
    token_budget=16,
    micro_batch_timeout=5.0,
    step_timeout=30.0,
) as rt:
    try:
        for step, lengths in enumerate(MINIBATCHES):
            for mb in rt.step(lengths):
                w = mb.gather("w")
                if rt.rank == 1 and step == 1:
                    os._exit(9)  # killed mid-step, holding a micro-batch
                loss, grad = loss_and_grad(w, mb.samples, lengths)
                mb.push("w", grad)
                mb.finish(loss)
        print(f"rank {rt.rank}: all steps passed", flush=True)
    except odc.StepError as e:
        print(f"rank {rt.rank}: StepError: {e}", flush=True)
        sys.exit(3)
