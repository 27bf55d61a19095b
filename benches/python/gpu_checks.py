"""The Python package's GPU path on a CUDA device: one row per check, PASS or FAIL with its
figures (benches/gpu/python.sh runs it on the GPU machine; nothing here runs without a GPU).

- A gathered unit is a CUDA tensor whose ``data_ptr`` is odc's device buffer (no copy).
- The trainer API on the device trains what the host path trains (SGD on a linear unit, 3 steps).
- bf16 pulls arrive as bf16 device tensors, and a bf16 CUDA gradient is taken (sent as fp32).
- The GPU path moved 0 bytes through host memory (``Runtime.host_bytes``).
- ``examples/python/sft.py --device cuda``: odc.torch.shard on the device equals PyTorch alone on
  the device (a tiny Llama, 3 AdamW steps), in one process and under
  ``torchrun --nproc-per-node 2`` (two ranks on the device, odc's cuda transport between them).

    python benches/python/gpu_checks.py
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import odc
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from test_trainer import LR, MINIBATCHES, UNIT, loss_and_grad  # noqa: E402

EXAMPLE = ROOT / "examples" / "python" / "sft.py"
TINY = ["--hidden", "64", "--layers", "3", "--heads", "4", "--batch", "8", "--steps", "3"]
FAILED: list[str] = []
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)


def sgd(**options):
    """test_trainer's SGD job over a torch unit (gathers are torch tensors)."""
    defaults = dict(optimizer="sgd", lr=LR, trainers=2, servers=2, token_budget=16)
    defaults.update(options)
    return odc.init({"w": torch.zeros(UNIT)}, **defaults)


def row(name: str, ok: bool, figures: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}\t{name}\t{figures}", flush=True)
    if not ok:
        FAILED.append(name)


def checked(name: str):
    def wrap(check):
        try:
            ok, figures = check()
        except Exception:  # a check that raises is a failed row, and the others still run
            ok, figures = False, traceback.format_exc().strip().splitlines()[-1]
        row(name, ok, figures)
        return check

    return wrap


def train_on(rt, device: str) -> list[np.ndarray]:
    """test_trainer's SGD loop, its arithmetic in torch on ``device``: the gathered values."""
    seen = []
    for lengths in MINIBATCHES:
        for mb in rt.step(lengths):
            w = mb.gather("w")
            assert w.device.type == torch.device(device).type, w.device
            loss, grad = loss_and_grad(w.float().cpu().numpy(), mb.samples, lengths)
            mb.push("w", torch.from_numpy(grad).to(device))
            mb.finish(loss)
            seen.append(w.float().cpu().numpy().copy())
    return seen


@checked("gather views odc's device buffer")
def _():
    rt = sgd(trainers=1, servers=1, device="cuda")
    mb = next(iter(rt.step([4])))
    raw = mb._turn.gather("w")
    view = torch.from_dlpack(raw)
    ok = view.is_cuda and view.data_ptr() == raw.address and mb.on_device
    mb.push("w", torch.zeros(UNIT, device="cuda"))
    mb.finish(0.0)
    rt.close()
    return ok, f"{raw!r}, view at {view.data_ptr():#x} on {view.device}"


@checked("trainer API on the device trains what the host path trains")
def _():
    host = sgd(trainers=2, servers=2)
    want = train_on(host, "cpu")
    host_final = host.parameters()["w"].numpy().copy()
    host.close()
    rt = sgd(trainers=2, servers=2, device="cuda")
    got = train_on(rt, "cuda")
    final = rt.parameters()["w"].numpy().copy()
    host_bytes = rt.host_bytes
    rt.close()
    err = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
    err = max(err, float(np.abs(final - host_final).max()))
    ok = len(got) == len(want) and err <= 1e-6 and host_bytes == 0
    return ok, f"max |device - host| {err:.2e} over {len(got)} gathers, host bytes {host_bytes}"


@checked("bf16 pulls and a bf16 CUDA gradient")
def _():
    rt = sgd(trainers=1, servers=1, device="cuda", precision="bf16")
    step = rt.step([4])
    mb = next(iter(step))
    w = mb.gather("w")
    mb.push("w", torch.ones(UNIT, device="cuda", dtype=torch.bfloat16))
    mb.finish(0.0)
    list(step)
    after = rt.parameters()["w"]
    rt.close()
    # SGD from zeros, the gradient 1 per element divided by 4 tokens.
    err = float((after + LR / 4).abs().max())
    return w.dtype == torch.bfloat16 and err <= 1e-7, f"gathered {w.dtype}, update err {err:.1e}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sft(flags: list[str], ranks: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", ODC_SECRET=os.urandom(16).hex())
    env.pop("ODC_TRANSPORT", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "log.pt"
        launch = []
        if ranks > 1:
            launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
            launch += ["--master-port", str(free_port())]
        args = [sys.executable, *launch, str(EXAMPLE), *TINY, *flags, "--out", str(out)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(flags)}: {done.stderr.strip().splitlines()[-1:]}")
        return torch.load(out, weights_only=False)


def same_training(odc_log: dict, plain_log: dict) -> tuple[bool, str]:
    losses = max(abs(a - b) / abs(b) for a, b in zip(odc_log["losses"], plain_log["losses"]))
    params = max(
        float((odc_log["state"][k].float() - v.float()).abs().max() / (v.abs().max() + 1e-12))
        for k, v in plain_log["state"].items()
    )
    ok = losses <= 1e-4 and params <= 1e-4 and odc_log["host_bytes"] == 0
    figures = f"losses rel {losses:.1e}, parameters rel {params:.1e}"
    return ok, f"{figures}, host bytes {odc_log['host_bytes']}"


@checked("sft.py --device cuda: odc.torch.shard equals PyTorch alone, one process")
def _():
    return same_training(sft(["--device", "cuda"]), sft(["--device", "cuda", "--plain"]))


@checked("sft.py --device cuda: 2 ranks under torchrun equal PyTorch alone")
def _():
    return same_training(sft(["--device", "cuda"], ranks=2), sft(["--device", "cuda", "--plain"]))


sys.exit(1 if FAILED else 0)
