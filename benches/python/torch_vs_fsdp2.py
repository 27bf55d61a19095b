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

Use a release wheel (``pip install ./python`` builds one): a debug build's copies are ten times
slower. One thread per rank (``OMP_NUM_THREADS=1``), so two ranks fit two cores.

    python benches/python/torch_vs_fsdp2.py [--steps 12] [--warmup 2]
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
WORKLOADS = {"balanced": ["--long-tail", "0"], "imbalanced": ["--long-tail", "1"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, ranks: int, flags: list[str], steps: int, warmup: int) -> float:
    """One run's seconds per timed step."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", ODC_TRANSPORT=os.environ.get("ODC_TRANSPORT", "tcp")
    )
    env.setdefault("ODC_SECRET", os.urandom(16).hex())
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "log.pt"
        args = [str(EXAMPLE), *MODEL, *flags, "--steps", str(steps), "--out", str(out)]
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
        log = torch.load(out, weights_only=False)
    timed = log["step_s"][warmup:]
    return sum(timed) / len(timed)


def abba(baseline: str, ranks: int, flags: list[str], steps: int, warmup: int) -> tuple:
    """(baseline's s/step, odc's s/step, control): the runs in ABBA order."""
    a1 = run(baseline, ranks, flags, steps, warmup)
    b1 = run("odc", ranks, flags, steps, warmup)
    b2 = run("odc", ranks, flags, steps, warmup)
    a2 = run(baseline, ranks, flags, steps, warmup)
    return (a1 + a2) / 2, (b1 + b2) / 2, a2 / a1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, model {' '.join(MODEL)}")
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
    for name, baseline, ranks, flags, label, kind in rows:
        base, ours, control = abba(baseline, ranks, flags, args.steps, args.warmup)
        # speed: odc's steps/s over the baseline's; time: odc's step time over the baseline's.
        ratio = base / ours if kind == "speed" else ours / base
        print(f"{name:34} {label:24} {base:11.3f} {ours:10.3f} {ratio:6.2f}x {control:.2f}")


if __name__ == "__main__":
    main()
