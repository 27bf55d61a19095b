"""odc.torch.shard: a `transformers` Llama trained through odc equals the same model trained by
PyTorch alone and by FSDP2 (over gloo, under torchrun), with tied embeddings, frozen parameters
and activation checkpointing; and the wrapper frees what FSDP2 frees."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="odc.torch needs torch (CI installs it)")
pytest.importorskip("transformers", reason="the parity model is transformers' Llama")

import odc  # noqa: E402
import odc.torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python" / "sft.py"
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--batch", "8", "--steps", "3"]
TINY += ["--problems", "64", "--max-steps", "12", "--token-budget", "800", "--lr", "1e-2"]


def example():
    spec = importlib.util.spec_from_file_location("sft_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sft = example()


def relative(a, b):
    """‖a − b‖ / ‖b‖: an element-wise bound fails PyTorch against itself (3e-5 here between two
    micro-batch groupings of one minibatch, where AdamW's m/√v amplifies a summation order's
    rounding in near-zero gradients); this measure reads 1.7e-6 between the two."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def assert_same_state(got, want, tol=1e-5):
    assert set(got) == set(want)
    # `not r <= tol` holds for NaN too (a max over tuples could pass one over).
    off = {k: r for k in want if not (r := relative(got[k], want[k])) <= tol}
    assert not off, f"tensors differ past {tol:.0e} relative: {off}"


def plain(argv):
    """PyTorch alone on the same samples: odc's reference."""
    return sft.main([*argv, "--plain"])


def test_units_hold_each_parameter_once_ties_in_the_root_and_frozen_apart():
    model = sft.model_from(sft.arguments(TINY))
    model.model.layers[1].mlp.requires_grad_(False)
    units = odc.torch.assign(model, list(model.model.layers))
    names = [u.name for u in units]
    assert names == ["root", "model.layers.0", "model.layers.1", "model.layers.1.frozen"]
    held = [id(p) for u in units for _, p in u.params]
    assert len(held) == len(set(held)) == len(list(model.parameters()))
    root = dict(units[0].params)
    assert "model.embed_tokens.weight" in root and "lm_head.weight" not in root  # tied: once
    assert all(not p.requires_grad for _, p in units[3].params) and units[3].frozen
    with pytest.raises(odc.InvalidArgument, match="not a submodule"):
        odc.torch.assign(model, [torch.nn.Linear(2, 2)])


def test_odc_trains_what_pytorch_alone_trains_over_two_trainers_in_one_process():
    want = plain(TINY)
    model = sft.model_from(sft.arguments(TINY))
    data = [sft.encode(r) for r in sft.problems(sft.arguments(TINY))]
    args = sft.arguments(TINY)
    sharded = odc.torch.shard(
        model,
        model.model.layers,
        lr=args.lr,
        weight_decay=args.weight_decay,
        token_budget=args.token_budget,
        trainers=2,
        servers=2,
    )
    counts, losses = [], []
    with sharded:
        for step in range(args.steps):
            samples = sft.minibatch(data, step, args)
            run = sharded.step([len(s[0]) for s in samples], [sft.loss_tokens(s) for s in samples])
            per = {}
            for mb in run:
                per[mb._mb._turn.trainer] = per.get(mb._mb._turn.trainer, 0) + 1
                with mb:
                    loss = sft.loss_sum(model, sft.collate([samples[i] for i in mb.samples]), args)
                    loss.backward()
                    mb.finish(loss)
            counts.append(sorted(per.values()))
            losses.append(run.stats["loss"])
        got = sharded.state_dict()
    assert losses == pytest.approx(want["losses"], rel=1e-5)
    assert_same_state(got, want["state"])
    assert any(c[0] != c[-1] for c in counts), counts  # trainers ran different counts
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # tied: one


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_trains_the_same(reentrant):
    args = sft.arguments(TINY)
    want = plain(TINY)
    model = sft.model_from(args)
    sft.checkpointing(model, reentrant)
    calls = []
    # transformers checkpoints a layer's forward inside its hooks (FSDP2's wrapper hooks too):
    # the block's own hooks run once, what it calls runs again in the backward.
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    got, micro_batches = run_odc(model, args)
    assert len(calls) == 2 * micro_batches  # each forward recomputed in the backward
    assert_same_state(got, want["state"])


def run_odc(model, args, **options):
    """The example's loop through odc.torch in one process: the state dict, the micro-batches."""
    data = [sft.encode(r) for r in sft.problems(args)]
    options = dict(
        lr=args.lr,
        weight_decay=args.weight_decay,
        token_budget=args.token_budget,
        trainers=1,
        servers=1,
        **options,
    )
    count = 0
    with odc.torch.shard(model, model.model.layers, **options) as sharded:
        for step in range(args.steps):
            samples = sft.minibatch(data, step, args)
            lengths = [len(s[0]) for s in samples]
            for mb in sharded.step(lengths, [sft.loss_tokens(s) for s in samples]):
                with mb:
                    loss = sft.loss_sum(model, sft.collate([samples[i] for i in mb.samples]), args)
                    loss.backward()
                    mb.finish(loss)
                count += 1
        return sharded.state_dict(), count


def test_frozen_parameters_are_pulled_never_pushed_and_the_rest_trains_as_pytorch():
    args = sft.arguments(TINY)
    freeze = ("model.embed_tokens", "model.layers.0.self_attn")

    def frozen_model():
        model = sft.model_from(args)
        for name, module in model.named_modules():
            if name in freeze:
                module.requires_grad_(False)
        return model

    initial = {k: v.clone() for k, v in frozen_model().state_dict().items()}
    reference = frozen_model()
    want = sft.train_plain(args, reference, [sft.encode(r) for r in sft.problems(args)])
    got, _ = run_odc(frozen_model(), args)
    assert_same_state(got, want["state"])
    assert torch.equal(got["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    assert not torch.equal(got["model.norm.weight"], initial["model.norm.weight"])


def test_a_block_is_freed_after_its_forward_and_the_model_refuses_to_run_outside_a_micro_batch():
    args = sft.arguments(TINY)
    model = sft.model_from(args)
    seen = []
    blocks = model.model.layers

    def probe(module, inputs):
        seen.append(blocks[0].mlp.up_proj.weight.untyped_storage().nbytes())

    blocks[1].register_forward_pre_hook(probe)
    sample = sft.encode(sft.problems(args)[0])
    with odc.torch.shard(model, blocks, trainers=1, servers=1) as sharded:
        with pytest.raises(odc.InvalidArgument, match="outside a micro-batch"):
            model(input_ids=torch.tensor([sample[0]]))
        for mb in sharded.step([len(sample[0])]):
            with mb:
                loss = sft.loss_sum(model, sft.collate([sample]), args)
                assert seen == [0]  # block 0 freed before block 1 ran
                loss.backward()
                mb.finish(loss)
        assert blocks[0].mlp.up_proj.weight.untyped_storage().nbytes() == 0
        with sharded.full_parameters():
            logits = model(input_ids=torch.tensor([sample[0]])).logits
        assert torch.isfinite(logits).all()
        run = sharded.step([len(sample[0])])
        mb = next(iter(run))
        with pytest.raises(odc.InvalidArgument, match="without finish"):
            with mb:
                pass
        with pytest.raises(odc.StepError):
            list(run)


def torchrun(tmp_path, mode):
    out = tmp_path / f"{mode}.pt"
    env = dict(
        os.environ, ODC_SECRET="the secret of this test", ODC_TRANSPORT="tcp", OMP_NUM_THREADS="1"
    )
    flags = ["--fsdp2"] if mode == "fsdp2" else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(EXAMPLE),
        *TINY,
        *flags,
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out, weights_only=False)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_odc_equals_pytorch_alone_and_fsdp2_over_gloo(tmp_path):
    want = plain(TINY)
    odc_run = torchrun(tmp_path, "odc")
    fsdp2 = torchrun(tmp_path, "fsdp2")
    assert odc_run["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert fsdp2["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert_same_state(odc_run["state"], want["state"])
    assert_same_state(odc_run["state"], fsdp2["state"])
    assert want["losses"][-1] < want["losses"][0]  # it trained


def test_the_example_resumes_from_its_checkpoint_under_the_models_own_names(tmp_path):
    want = plain(TINY)
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    first = [a if a != "3" else "2" for a in TINY]  # two of the three steps
    sft.main([*first, *ckpt, "--checkpoint-every", "2"])
    state = (tmp_path / "step-2" / "state.json").read_text()
    assert "model.layers.0.mlp.up_proj.weight" in state and "lm_head" not in state  # tied: once
    resumed = sft.main([*TINY, *ckpt, "--resume", "auto"])
    assert resumed["losses"] == pytest.approx(want["losses"][2:], rel=1e-5)
    assert_same_state(resumed["state"], want["state"])


def test_a_gradient_after_its_units_push_is_refused_not_lost():
    args = sft.arguments(TINY)
    model = sft.model_from(args)
    sample = sft.encode(sft.problems(args)[0])
    with odc.torch.shard(model, model.model.layers, trainers=1, servers=1) as sharded:
        run = sharded.step([len(sample[0])])
        mb = next(iter(run))
        with pytest.raises(odc.InvalidArgument, match="came after the unit was pushed"):
            with mb:
                sft.loss_sum(model, sft.collate([sample]), args).backward()
                sft.loss_sum(model, sft.collate([sample]), args).backward()  # a second backward
        with pytest.raises(odc.StepError):
            list(run)
    # A failed shard leaves the model as it was.
    model = sft.model_from(args)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(odc.InvalidArgument, match="optimizer"):
        odc.torch.shard(model, model.model.layers, optimizer="lion", trainers=1, servers=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
