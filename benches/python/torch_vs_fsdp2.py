"""odc.torch against FSDP2 and against PyTorch alone, on the CPU: ratios from one run.

Every row runs ``examples/python/sft.py`` (a `transformers` Llama made from a config, the same
samples, the same PyTorch compute) in ABBA order — baseline, odc, odc, baseline — and prints
odc's speed over the baseline's (steps per second over the timed steps, warm-up steps left out)
beside the control, the baseline's second pair of runs over its first, which reads 1.00 when the
machine is quiet. Rows:

- **2 ranks, balanced lengths** (every problem two steps long) and **2 ranks, imbalanced
  lengths** (a long tail, as LongAlign's: most samples short, a few many times longer): odc
  under ``torchrun --nproc-per-node 2`` against FSDP2 over gloo, whose micro-batches are odc's
  planner with equal counts (LB-Micro, what its lockstep collectives allow, ODC's FSDP baseline).
- The same imbalanced lengths against FSDP2 as most loops feed it: ``DistributedSampler``'s
  share of the samples (``--fsdp2-split sampler``), one micro-batch per rank.
- **Overhead, one rank**: odc in one process (one trainer, one shard server) against PyTorch
  alone on the same micro-batches (``--plain``): odc's step time over PyTorch's.
- ``--gpu``: the same overhead row on one GPU, odc on its GPU path (``--device cuda``: shard
  servers on the device, gathers into and pushes from device memory) against PyTorch alone on
  the device, the SmolLM2-135M shape under bf16 autocast; with each run's first loss (odc's and
  PyTorch's, which start from the same weights and samples) and the bytes odc's gathers and
  pushes moved through host memory (0 on the GPU path).

Use a release wheel (``pip install ./python`` builds one): a debug build's copies are ten times
slower. One thread per rank (``OMP_NUM_THREADS=1``), so two ranks fit two cores.

    python benches/python/torch_vs_fsdp2.py [--steps 12] [--warmup 2] [--gpu]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "sft.py"
MODEL = ["--hidden", "128", "--layers", "4", "--heads", "4", "--batch", "16"]
# SmolLM2-135M's shape (its config.json): 30 blocks of 576, 9 heads over 3 KV heads, MLP 1536,
# 49152 tied embedding rows.
SMOLLM2_135M = [
    *["--hidden", "576", "--layers", "30", "--heads", "9", "--kv-heads", "3"],
    *["--intermediate", "1536", "--vocab", "49152", "--batch", "16", "--token-budget", "8192"],
]
WORKLOADS = {"balanced": ["--long-tail", "0"], "imbalanced": ["--long-tail", "1"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, ranks: int, flags: list[str], steps: int, model: list[str]) -> dict:
    """One run's log (losses, seconds per step, host bytes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ranks > 1:
        env.setdefault("ODC_TRANSPORT", "tcp")
    env.setdefault("ODC_SECRET", os.urandom(16).hex())
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "log.pt"
        args = [str(EXAMPLE), *model, *flags, "--steps", str(steps), "--out", str(out)]
        args += {"odc": [], "fsdp2": ["--fsdp2"], "plain": ["--plain"]}[mode]
        if ranks > 1:
            launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
            launch += ["--master-port", str(free_port())]
        else:
            launch = []
        done = subprocess.run(
            [sys.executable, *launch, *args], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{done.stdout}\n{done.stderr}")
        return torch.load(out, weights_only=False)


def per_step(log: dict, warmup: int) -> float:
    timed = log["step_s"][warmup:]
    return sum(timed) / len(timed)


def abba(baseline: str, ranks: int, flags: list[str], args: argparse.Namespace) -> tuple:
    """(baseline's s/step, odc's s/step, control, the four logs): the runs in ABBA order."""
    model = SMOLLM2_135M if args.gpu else MODEL
    logs = [run(m, ranks, flags, args.steps, model) for m in (baseline, "odc", "odc", baseline)]
    a1, b1, b2, a2 = (per_step(log, args.warmup) for log in logs)
    return (a1 + a2) / 2, (b1 + b2) / 2, a2 / a1, logs


def gpu_rows() -> list:
    return [
        (
            "overhead, 1 rank, GPU, SmolLM2-135M shape, bf16",
            "plain",
            1,
            ["--long-tail", "1", "--device", "cuda", "--bf16"],
            "PyTorch alone (cuda)",
            "time",
        )
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu", action="store_true", help="the GPU row (one CUDA device) only")
    args = p.parse_args()
    model = SMOLLM2_135M if args.gpu else MODEL
    where = torch.cuda.get_device_name() if args.gpu else f"{os.cpu_count()} CPUs"
    print(f"torch {torch.__version__}, {where}, model {' '.join(model)}")
    print(f"{'row':34} {'baseline':24} {'base s/step':>11} {'odc s/step':>10} {'ratio':>7} ctl")
    rows = [
        (f"2 ranks, {name} lengths", "fsdp2", 2, flags, "FSDP2 (gloo, LB-Micro)", "speed")
        for name, flags in WORKLOADS.items()
    ]
    sampler = [*WORKLOADS["imbalanced"], "--fsdp2-split", "sampler"]
    rows.append(
        ("2 ranks, imbalanced lengths", "fsdp2", 2, sampler, "FSDP2 (gloo, sampler)", "speed")
    )
    rows.append(
        (
            "overhead, 1 rank, imbalanced",
            "plain",
            1,
            WORKLOADS["imbalanced"],
            "PyTorch alone",
            "time",
        )
    )
    if args.gpu:
        rows = gpu_rows()
    for name, baseline, ranks, flags, label, kind in rows:
        base, ours, control, logs = abba(baseline, ranks, flags, args)
        # speed: odc's steps/s over the baseline's; time: odc's step time over the baseline's.
        ratio = base / ours if kind == "speed" else ours / base
        print(f"{name:34} {label:24} {base:11.3f} {ours:10.3f} {ratio:6.2f}x {control:.2f}")
        if args.gpu:
            first = [log["losses"][0] for log in logs]
            print(f"  first loss: PyTorch {first[0]:.6f}, odc {first[1]:.6f} (ABBA: {first})")
            print(f"  odc's host bytes: {[log.get('host_bytes') for log in logs[1:3]]}")


if __name__ == "__main__":
    main()
