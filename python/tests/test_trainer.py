"""The trainer API from Python: odc's runtime trains what a plain numpy loop trains, its gathers
are views of odc's buffers, and every bad input or stuck rank ends in a named exception."""

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import odc

UNIT = 16
LR = 0.01
HERE = pathlib.Path(__file__).resolve().parent


def sample_x(index):
    return np.array([(index + i) % 7 for i in range(UNIT)], dtype=np.float32)


def loss_and_grad(w, samples, lengths):
    """The README's linear unit: squared error of w·x − 1 per token, summed over the samples."""
    loss, grad = 0.0, np.zeros(UNIT, dtype=np.float32)
    for s in samples:
        x = sample_x(s)
        err = float(w @ x) - 1.0
        loss += 0.5 * err * err * lengths[s]
        grad += np.float32(err * lengths[s]) * x
    return loss, grad


def reference(minibatches, steps_lr=LR):
    """Plain SGD on the mean loss per token of each minibatch, in float64."""
    w = np.zeros(UNIT)
    for lengths in minibatches:
        grad = np.zeros(UNIT)
        for s, n in enumerate(lengths):
            x = sample_x(s).astype(np.float64)
            grad += (w @ x - 1.0) * n * x
        w -= steps_lr * grad / sum(lengths)
    return w


def train(rt, minibatches, on_micro_batch=None):
    stats = []
    for lengths in minibatches:
        step = rt.step(lengths)
        for mb in step:
            if on_micro_batch is not None:
                on_micro_batch(mb)
            w = mb.gather("w")
            loss, grad = loss_and_grad(w, mb.samples, lengths)
            mb.push("w", grad)
            mb.finish(loss)
        stats.append(step.stats)
    return stats


MINIBATCHES = [[3, 9, 1, 7, 5, 2, 8, 4], [6, 6, 1, 9, 2, 3, 7, 5], [1, 2, 3, 4, 5, 6, 7, 8]]


def sgd_runtime(**options):
    units = {"w": np.zeros(UNIT, dtype=np.float32)}
    defaults = dict(optimizer="sgd", lr=LR, trainers=2, servers=2, token_budget=16)
    defaults.update(options)
    return odc.init(units, **defaults)


def test_odc_trains_what_plain_sgd_trains():
    with sgd_runtime() as rt:
        stats = train(rt, MINIBATCHES)
        got = rt.parameters()["w"]
    want = reference(MINIBATCHES)
    assert np.max(np.abs(got - want)) <= 1e-5, (got, want)
    assert np.max(np.abs(want)) > 1e-2  # it trained
    assert [s["step"] for s in stats] == [0, 1, 2]
    assert all(s["tokens"] == sum(m) for s, m in zip(stats, MINIBATCHES))


def test_ranks_with_one_and_three_micro_batches_finish_equal_to_the_balanced_run():
    # Attention's quadratic cost: one 64K-token sample costs about what three of 33K cost, and
    # no two of those fit a micro-batch, so one rank runs one micro-batch and the other three.
    lengths = [[64_000, 33_000, 33_000, 33_000]]
    with sgd_runtime(token_budget=64_000) as rt:
        counts = {}

        def count(mb):
            counts.setdefault(mb._turn.trainer, []).append(mb.id)

        train(rt, lengths, count)
        got = rt.parameters()["w"]
    assert sorted(len(v) for v in counts.values()) == [1, 3], counts
    assert np.max(np.abs(got - reference(lengths))) <= 1e-5


def test_ranks_with_one_and_five_micro_batches_under_dynamic_dispatch_finish_equal():
    # Six samples, no two of which fit a micro-batch; dynamic dispatch hands each to whichever
    # trainer asks next. The first is held unfinished (a slow rank), so the other trainer takes
    # the remaining five; the held one finishes last, and the step's barrier waits for it.
    lengths = [9] * 6
    with sgd_runtime(token_budget=16, dispatch="dynamic") as rt:
        step = rt.step(lengths)
        counts, held = {}, None
        for mb in step:
            counts.setdefault(mb._turn.trainer, []).append(mb.id)
            if held is None:
                held = mb
                continue
            w = mb.gather("w")
            loss, grad = loss_and_grad(w, mb.samples, lengths)
            mb.push("w", grad)
            mb.finish(loss)
            if sum(map(len, counts.values())) == len(lengths):
                w = held.gather("w")
                loss, grad = loss_and_grad(w, held.samples, lengths)
                held.push("w", grad)
                held.finish(loss)
        assert step.stats["micro_batches"] == 6
        got = rt.parameters()["w"]
    assert sorted(len(v) for v in counts.values()) == [1, 5], counts
    assert np.max(np.abs(got - reference([lengths]))) <= 1e-5


def test_a_gathered_unit_views_odcs_buffer_and_outlives_the_runtime():
    rt = sgd_runtime(trainers=1, servers=1)
    kept = []
    for mb in rt.step([4, 4]):
        a, b = mb.gather("w"), mb.gather("w")
        assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        kept.append(a)
        _, grad = loss_and_grad(a, mb.samples, [4, 4])
        mb.push("w", grad)
        mb.finish(0.0)
    rt.close()
    del rt
    # Still readable after the runtime is gone: the first step's parameters, zeros.
    assert all(k.shape == (UNIT,) and not k.any() for k in kept)


def test_bad_dtypes_shapes_units_and_a_closed_runtime_are_named():
    rt = sgd_runtime(trainers=1, servers=1)
    step = rt.step([4])
    with pytest.raises(odc.InvalidArgument, match="already running"):
        rt.step([4])
    # Waiting for the job during a step would wait for this thread, which drives the step.
    for call in (rt.parameters, lambda: rt.steps_done, rt.save_checkpoint):
        with pytest.raises(odc.InvalidArgument, match="already running"):
            call()
    mb = next(iter(step))
    with pytest.raises(odc.InvalidArgument, match="float64"):
        mb.push("w", np.zeros(UNIT, dtype=np.float64))
    with pytest.raises(odc.InvalidArgument, match="has 3 elements"):
        mb.push("w", np.zeros(3, dtype=np.float32))
    with pytest.raises(odc.InvalidArgument, match="not contiguous"):
        mb.push("w", np.zeros(2 * UNIT, dtype=np.float32)[::2])
    with pytest.raises(odc.InvalidArgument, match="__dlpack__"):
        mb.push("w", [0.0] * UNIT)
    with pytest.raises(odc.UnknownUnit, match='unit "v" is not one of') as caught:
        mb.gather("v")
    assert isinstance(caught.value, KeyError)
    mb.gather("w")
    mb.push("w", np.zeros(UNIT, dtype=np.float32))
    mb.finish(0.0)
    with pytest.raises(odc.Closed, match="finished"):
        mb.finish(0.0)
    assert list(step) == []
    assert step.stats["micro_batches"] == 1
    rt.close()
    with pytest.raises(odc.Closed, match="closed"):
        rt.step([4])
    with pytest.raises(odc.InvalidArgument, match="optimizer"):
        sgd_runtime(optimizer="lion")


def test_a_micro_batch_never_finished_fails_the_step_by_its_deadline_naming_it():
    rt = sgd_runtime(trainers=1, servers=1, micro_batch_timeout=0.5, step_timeout=10.0)
    started = time.monotonic()
    held = []
    # The trainer's deadline, or the driven compute's own (the same length), names it.
    named = r"micro-batch 0\) ran past its deadline|micro-batch 0 of step 0: .* within"
    with pytest.raises(odc.StepError, match=named):
        for mb in rt.step([4, 4]):
            held.append(mb)  # computed never, finished never
    assert time.monotonic() - started < 10.0
    rt.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(script, *args, world=2, per_host=None):
    """Starts `script` as the ranks of a job under torchrun's variables (`world` ranks,
    `per_host` a host: torchrun's LOCAL_WORLD_SIZE, where given): (codes, logs)."""
    port, procs = free_port(), []
    for rank in range(world):
        host = {} if per_host is None else dict(LOCAL_WORLD_SIZE=str(per_host))
        env = dict(
            os.environ,
            **host,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank if per_host is None else rank % per_host),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            ODC_SECRET="the secret of this test job",
            ODC_TRANSPORT="tcp",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), *[a.format(rank=rank) for a in args]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [p.returncode for p in procs], logs


def test_two_ranks_under_torchruns_variables_train_what_one_process_trains(tmp_path):
    codes, logs = two_ranks("two_ranks.py", str(tmp_path / "rank{rank}.npy"))
    assert codes == [0, 0], "\n".join(logs)
    got = np.load(tmp_path / "rank0.npy")
    assert np.max(np.abs(got - reference(MINIBATCHES))) <= 1e-5
    assert "rank 1 computed" in logs[1] and "micro-batches" in logs[1]


def test_four_ranks_on_two_hosts_relay_their_pushes_by_default_and_train_the_same(tmp_path):
    flushes = {}
    for mode in ["relayed", "direct"]:
        args = [str(tmp_path / f"{mode}{{rank}}.npy")] + (["direct"] if mode == "direct" else [])
        codes, logs = two_ranks("two_ranks.py", *args, world=4, per_host=2)
        assert codes == [0, 0, 0, 0], "\n".join(logs)
        got = np.load(tmp_path / f"{mode}0.npy")
        assert np.max(np.abs(got - reference(MINIBATCHES))) <= 1e-5, mode
        flushes[mode] = sum(int(log.split("early relay flushes ")[1].split()[0]) for log in logs)
    # Static plans: each host's relays flush once its writes are in, before the barrier.
    assert flushes["relayed"] > 0 and flushes["direct"] == 0, flushes


def test_a_short_or_missing_secret_under_torchrun_is_named_by_init(monkeypatch):
    world = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in world.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ODC_SECRET", "short")
    with pytest.raises(odc.InvalidArgument, match="ODC_SECRET: the cluster secret is 5 bytes"):
        sgd_runtime()
    monkeypatch.delenv("ODC_SECRET")
    with pytest.raises(odc.InvalidArgument, match="ODC_SECRET is not set"):
        sgd_runtime()


def test_a_rank_killed_mid_step_stops_the_job_naming_what_was_lost_by_its_deadline():
    started = time.monotonic()
    codes, logs = two_ranks("killed_rank.py")
    assert codes[1] == 9, logs[1]
    # Its shard server went with it: rank 0's step fails, naming the lost server or rank.
    assert codes[0] == 3, logs[0]
    assert re.search(r"StepError: .*(shard server 1|rank 1|trainer 1)", logs[0]), logs[0]
    assert time.monotonic() - started < 90


def test_the_trainer_example_in_the_docs_runs():
    """The loop docs/python.md shows, run as it is written."""
    docs = HERE.parents[1] / "docs" / "python.md"
    blocks = re.findall(r"```python\n(.*?)```", docs.read_text(), flags=re.S)
    loop = next(b for b in blocks if "odc.init" in b)
    scope = {}
    exec(compile(loop, str(docs), "exec"), scope)
    assert scope["w"].shape == (16,) and np.abs(scope["w"]).max() > 0
