"""SFT of a `transformers` Llama model through odc, or through FSDP2 for comparison.

The model is made from a config (no download) and trained on GSM8K-style chat that this script
generates (or on a GSM8K JSONL file, ``--data``), with bytes for tokens and the loss on the
answers only. One loop, three ways:

    torchrun --nproc-per-node 2 examples/python/sft.py           # odc.torch.shard
    torchrun --nproc-per-node 2 examples/python/sft.py --fsdp2   # fully_shard, over gloo
    python examples/python/sft.py --plain                        # PyTorch alone, one process

On the CPU by default; ``--device cuda`` (with ``--bf16`` for bf16 autocast) runs the model on
the GPU, and odc on its GPU path: shard servers on the device, gathers into and pushes from
device memory, no byte through the host. Export ODC_SECRET (16 bytes or more, the same on every
rank) for odc under torchrun.

odc plans each minibatch into micro-batches per rank (balanced by cost, within
``--token-budget``; counts may differ between ranks), gathers each decoder block on demand and
pushes its gradient as autograd makes it; AdamW runs at odc's shard servers after the step's one
barrier. FSDP2's collectives run in lockstep, so every rank runs the same count: odc's planner
with equal counts (LB-Micro, ODC's FSDP baseline), or ``--fsdp2-split sampler``, one micro-batch
of ``DistributedSampler``'s samples (``r``, ``r + world``, ...); the gradients reduce-scattered
once per step, AdamW on each rank's shard. ``--plain`` runs odc's plan for one rank with
PyTorch's AdamW and gradient accumulation: odc's reference, and the loop odc's overhead is
measured against. All three train the token mean of the minibatch's answer loss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

USER, ASSISTANT, END, PAD = 256, 257, 258, 259
VOCAB = 260
NAMES = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia"]
THINGS = ["apples", "stamps", "marbles", "books", "coins", "shells", "pencils", "cards"]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--fsdp2", action="store_true", help="fully_shard instead of odc")
    mode.add_argument("--plain", action="store_true", help="PyTorch alone, one process")
    p.add_argument(
        "--fsdp2-split",
        choices=["balanced", "sampler"],
        default="balanced",
        help="FSDP2's micro-batches: odc's planner with equal counts (LB-Micro), or one per rank "
        "of DistributedSampler's samples",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="samples per minibatch")
    p.add_argument("--token-budget", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument("--problems", type=int, default=512, help="generated problems")
    p.add_argument("--long-tail", type=float, default=1.0, help="0: every problem two steps")
    p.add_argument("--max-steps", type=int, default=60, help="the most steps of one problem")
    p.add_argument("--data", help="a GSM8K JSONL file instead of generated problems")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="0: half the heads")
    p.add_argument("--intermediate", type=int, default=0, help="0: 4 × hidden")
    p.add_argument("--vocab", type=int, default=VOCAB, help="embedding rows (≥ the byte vocab)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the model and odc on the GPU")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast of the forward")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--checkpoint-dir", help="odc: where sharded checkpoints go")
    p.add_argument("--checkpoint-every", type=int, default=0, help="odc: steps between them")
    p.add_argument("--resume", help="odc: a step-<N> directory, or auto (the newest, if any)")
    p.add_argument("--out", help="write losses, step times and the final state dict (rank 0)")
    return p.parse_args(argv)


# -- data -------------------------------------------------------------------------------------


def problem(rng: random.Random, steps: int) -> dict[str, str]:
    """A GSM8K-style word problem of ``steps`` additions and subtractions, and its worked answer."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    total = rng.randint(2, 20)
    question = [f"{name} has {total} {thing}."]
    work = []
    for _ in range(steps):
        n = rng.randint(1, 9)
        if rng.random() < 0.5 or total <= n:
            question.append(f"Then {name} gets {n} more {thing}.")
            work.append(f"{total} + {n} = <<{total}+{n}={total + n}>>{total + n}")
            total += n
        else:
            question.append(f"Then {name} gives away {n} {thing}.")
            work.append(f"{total} - {n} = <<{total}-{n}={total - n}>>{total - n}")
            total -= n
    question.append(f"How many {thing} does {name} have now?")
    return {"question": " ".join(question), "answer": "\n".join(work) + f"\n#### {total}"}


def problems(args: argparse.Namespace) -> list[dict[str, str]]:
    """GSM8K's records from ``--data``, else generated ones whose step counts have a long tail
    (most problems short, a few many times longer: the imbalance long-context SFT sees)."""
    if args.data:
        with open(args.data) as f:
            return [json.loads(line) for line in f if line.strip()]
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.problems):
        tail = rng.paretovariate(1.2) if args.long_tail > 0 else 1.0
        steps = max(
            1, min(args.max_steps, int(round(args.long_tail * tail + (1 - args.long_tail) * 2)))
        )
        out.append(problem(rng, steps))
    return out


def encode(record: dict[str, str]) -> tuple[list[int], list[int]]:
    """A chat's token ids (bytes, with the roles' special tokens) and labels (-100 but the
    answer and its end)."""
    prompt = [USER, *record["question"].encode()[:4000], ASSISTANT]
    answer = [*record["answer"].encode()[:4000], END]
    return prompt + answer, [-100] * len(prompt) + answer


def loss_tokens(sample: tuple[list[int], list[int]]) -> int:
    """The tokens a sample's loss sums over: labels past the first position that are not -100."""
    return sum(1 for t in sample[1][1:] if t != -100)


def collate(samples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on padding)."""
    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), PAD, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, (x, y) in enumerate(samples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def minibatch(data: list[Any], step: int, args: argparse.Namespace) -> list[Any]:
    """Step ``step``'s samples: the same on every rank (a seeded shuffle per step)."""
    order = random.Random(args.seed * 1_000_003 + step).sample(range(len(data)), args.batch)
    return [data[i] for i in order]


# -- the model ---------------------------------------------------------------------------------


def model_from(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama made from a config: tied embeddings, grouped-query attention, seeded weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.vocab < VOCAB:
        raise SystemExit(f"--vocab {args.vocab}: the byte vocabulary needs {VOCAB} rows")
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
        max_position_embeddings=16_384,
        tie_word_embeddings=True,
        pad_token_id=PAD,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    if args.checkpointing:
        checkpointing(model, reentrant=False)
    return model.to(args.device).train()


def checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    """Activation checkpointing of every decoder layer, by whichever name transformers has."""
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers 5.x
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], args: argparse.Namespace
) -> torch.Tensor:
    """The summed cross-entropy of the batch's answer tokens (odc divides by the minibatch's),
    on ``--device``, under bf16 autocast with ``--bf16``."""
    batch = {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}
    kind = torch.device(args.device).type
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=args.bf16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch["labels"][:, 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )


# -- three loops -------------------------------------------------------------------------------


def train_odc(args: argparse.Namespace, model: torch.nn.Module, data: list[Any]) -> dict:
    import odc.torch

    alone = "WORLD_SIZE" not in os.environ
    sharded = odc.torch.shard(
        model,
        model.model.layers,
        optimizer="adamw",
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip_grad_norm=args.clip,
        token_budget=args.token_budget,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        device=args.device,
        **({"trainers": 1, "servers": 1} if alone else {}),
    )
    log = new_log()
    with sharded:
        if sharded.resumed is not None and sharded.rank == 0:
            print(f"resumed from {sharded.resumed.path}", flush=True)
        for step in range(sharded.steps_done, args.steps):
            samples = minibatch(data, step, args)
            started = time.perf_counter()
            run = sharded.step([len(s[0]) for s in samples], [loss_tokens(s) for s in samples])
            count = 0
            for mb in run:
                with mb:
                    loss = loss_sum(model, collate([samples[i] for i in mb.samples]), args)
                    loss.backward()
                    mb.finish(loss)
                count += 1
            record(log, sharded.rank, step, run.stats["loss"], started, count, args)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                written = sharded.save_checkpoint({"step": step + 1})
                if written is not None:
                    print(f"checkpoint: {written}", flush=True)
        log["state"] = sharded.state_dict()
        log["rank"] = sharded.rank
        log["host_bytes"] = sharded.runtime.host_bytes
    return log


def train_fsdp2(args: argparse.Namespace, model: torch.nn.Module, data: list[Any]) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    log = new_log()
    for step in range(args.steps):
        samples = minibatch(data, step, args)
        started = time.perf_counter()
        total = sum(loss_tokens(s) for s in samples)
        micro_batches = fsdp2_share(args, samples, rank, world)
        summed = torch.zeros(1, device=args.device)
        for i, indices in enumerate(micro_batches):
            # Reduce-scatter once, after the last micro-batch (FSDP2's gradient accumulation).
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss = loss_sum(model, collate([samples[j] for j in indices]), args)
            # FSDP2 averages gradients over ranks: scaled by the world, the sum is the token mean.
            (loss * world / total).backward()
            summed += loss.detach()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(summed)
        record(log, rank, step, float(summed) / total, started, len(micro_batches), args)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    log["state"] = get_model_state_dict(model, options=full)
    log["rank"] = rank
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    return log


def fsdp2_share(args: argparse.Namespace, samples: list[Any], rank: int, world: int) -> list:
    """This rank's micro-batches under FSDP2, the same count on every rank (its collectives run in
    lockstep): odc's planner with ``dispatch="equal"`` (LB-Micro, balanced by cost within the
    token budget), or with ``--fsdp2-split sampler`` the samples ``DistributedSampler`` gives this
    rank (``rank``, ``rank + world``, ...) in one micro-batch."""
    import odc

    if args.fsdp2_split == "sampler":
        return [list(range(rank, len(samples), world))]
    lengths = [len(s[0]) for s in samples]
    plan = odc.balance(lengths, ranks=world, token_budget=args.token_budget, dispatch="equal")
    return plan.samples()[rank]


def train_plain(args: argparse.Namespace, model: torch.nn.Module, data: list[Any]) -> dict:
    import odc

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    log = new_log()
    for step in range(args.steps):
        samples = minibatch(data, step, args)
        started = time.perf_counter()
        total = sum(loss_tokens(s) for s in samples)
        plan = odc.balance([len(s[0]) for s in samples], ranks=1, token_budget=args.token_budget)
        summed = 0.0
        micro_batches = plan.samples()[0]
        for indices in micro_batches:
            loss = loss_sum(model, collate([samples[i] for i in indices]), args)
            (loss / total).backward()
            summed += float(loss.detach())
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        record(log, 0, step, summed / total, started, len(micro_batches), args)
    log["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log["rank"] = 0
    return log


def new_log() -> dict[str, Any]:
    """What a loop records: each step's loss, seconds and micro-batches (then state, rank)."""
    return {"losses": [], "step_s": [], "micro_batches": []}


def record(
    log: dict, rank: int, step: int, loss: float, started: float, count: int, args: Any
) -> None:
    """Records a step that began at ``started`` (``perf_counter``), once the device has run it,
    and prints it on rank 0."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    log["losses"].append(loss)
    log["step_s"].append(seconds)
    log["micro_batches"].append(count)
    if rank == 0:
        print(f"step {step} loss {loss:.6f} {seconds:.3f}s micro-batches {count}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = arguments(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.device == "cuda" and "LOCAL_RANK" in os.environ:
        # As torchrun's GPU loops place ranks (several ranks share a device where fewer exist).
        args.device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    data = [encode(r) for r in problems(args)]
    model = model_from(args)
    train = train_fsdp2 if args.fsdp2 else train_plain if args.plain else train_odc
    log = train(args, model, data)
    if args.out and log["rank"] == 0:
        torch.save(log, args.out)
    if log["rank"] == 0 and log["losses"]:
        print(f"final loss {log['losses'][-1]:.6f}", flush=True)
    elif log["rank"] == 0:
        print(f"nothing to do: the checkpoint is at step {args.steps} already", flush=True)
    return log


if __name__ == "__main__":
    main(sys.argv[1:])
