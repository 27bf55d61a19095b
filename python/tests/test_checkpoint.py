"""Checkpoints from Python: a job saved, stopped and resumed trains what one that never stopped
trains (AdamW's state included), under the names given; every bad checkpoint input is named."""

import json
import pathlib

import numpy as np
import pytest
from test_trainer import MINIBATCHES, UNIT, loss_and_grad

import odc


def runtime(**options):
    defaults = dict(optimizer="adamw", lr=0.05, trainers=2, servers=2, token_budget=16)
    defaults.update(options)
    return odc.init({"w": np.zeros(UNIT, dtype=np.float32)}, **defaults)


def train(rt, minibatches):
    for lengths in minibatches:
        for mb in rt.step(lengths):
            loss, grad = loss_and_grad(mb.gather("w"), mb.samples, lengths)
            mb.push("w", grad)
            mb.finish(loss)


def test_a_resumed_job_trains_what_one_that_never_stopped_trains(tmp_path):
    with runtime() as rt:
        train(rt, MINIBATCHES)
        want = rt.parameters()["w"].copy()
    with runtime(checkpoint_dir=str(tmp_path)) as rt:
        train(rt, MINIBATCHES[:2])
        written = rt.save_checkpoint({"data": [1, 2], "note": "after two steps"})
    assert pathlib.Path(written) == tmp_path / "step-2"
    assert (tmp_path / "step-2" / "state.json").is_file()
    with runtime(checkpoint_dir=str(tmp_path), resume="auto") as rt:
        assert rt.resumed == odc.Resumed(written, 2, {"data": [1, 2], "note": "after two steps"})
        assert rt.steps_done == 2
        train(rt, MINIBATCHES[2:])
        got = rt.parameters()["w"]
    # AdamW's moments came back too: without them the third step would differ.
    assert np.max(np.abs(got - want)) <= 1e-6, (got, want)
    with runtime(resume=written) as rt:
        assert rt.resumed.step == 2


def test_names_are_the_callers_and_bad_checkpoint_inputs_are_named(tmp_path):
    tensors = {"w": [("layer.weight", (4, 2)), ("layer.bias", (8,))]}
    with runtime(checkpoint_dir=str(tmp_path), tensors=tensors, trainers=1, servers=1) as rt:
        train(rt, MINIBATCHES[:1])
        step = pathlib.Path(rt.save_checkpoint())
    manifest = json.loads((step / "state.json").read_text())
    assert "layer.weight" in json.dumps(manifest) and "layer.bias" in json.dumps(manifest)
    with pytest.raises(odc.InvalidArgument, match=r'unit "w": its tensors hold 9 elements'):
        runtime(tensors={"w": [("a", (9,))]}, trainers=1, servers=1)
    with pytest.raises(odc.InvalidArgument, match="not units"):
        runtime(tensors={"v": [("a", (16,))]}, trainers=1, servers=1)
    with pytest.raises(odc.CheckpointError, match="step-7"):
        runtime(resume=str(tmp_path / "step-7"), trainers=1, servers=1)
    with pytest.raises(odc.InvalidArgument, match="checkpoint_dir"):
        runtime(resume="auto", trainers=1, servers=1)
    # A model whose tensors changed does not open the checkpoint.
    with pytest.raises(odc.CheckpointError):
        runtime(resume=str(step), trainers=1, servers=1)
    with runtime(trainers=1, servers=1) as rt:
        with pytest.raises(odc.InvalidArgument, match="checkpoint_dir"):
            rt.save_checkpoint()
        with pytest.raises(odc.InvalidArgument, match="JSON"):
            rt.save_checkpoint({"a": object()})
    # auto with nothing there: from scratch.
    with runtime(checkpoint_dir=str(tmp_path / "empty"), resume="auto") as rt:
        assert rt.resumed is None and rt.steps_done == 0
