#!/usr/bin/env python3
"""Makes tests/fixtures/hf/<case>/: small random models of the Llama, Qwen2 and Qwen3 families
saved by Python `transformers`' own `save_pretrained`, with the logits `transformers` computes for
a fixed token sequence (`logits.json`). `tests/hf_fixtures.rs` loads each directory with odc and
checks every position's logits against these: a reference that is not odc's, and a checkpoint
odc did not write.

    pip install torch transformers safetensors
    python3 scripts/hf_fixtures.py                 # rewrites tests/fixtures/hf/
    python3 scripts/hf_fixtures.py --check-export DIR [--against tests/fixtures/hf/CASE/logits.json]
                                                   # loads an odc export with from_pretrained and
                                                   # prints its logits, or their max |diff| from
                                                   # the fixture's (`tests/hf_parity.rs` writes
                                                   # odc's exports of the fixtures under
                                                   # target/tmp/hf-exports/)
    python3 scripts/hf_fixtures.py --generate       # adds generate.json to each case: greedy
                                                   # `generate` of PROMPTS, one at a time, and
                                                   # batched with left padding (they agree)
    python3 scripts/hf_fixtures.py --check-peft BASE ADAPTERS MERGED
                                                   # PEFT's LoRA on BASE with odc's adapters vs
                                                   # odc's merged export (pip install peft)

Every parameter is perturbed after initialisation (norm weights away from 1, biases away from 0)
so that a parameter read or applied wrongly shows in the logits.
"""
import argparse
import json
import pathlib
import shutil

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

TOKENS = [5, 17, 3, 88, 42, 42, 9, 60, 1, 33, 71, 2]

# Prompts of different lengths for `--generate`, each continued greedily by NEW_TOKENS tokens.
PROMPTS = [[7], [5, 17, 3, 88, 42], [60, 1, 33, 71, 2, 9, 9, 14, 80, 3, 3, 51], [90, 4, 4]]
NEW_TOKENS = 40

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def cases():
    return {
        "llama-gqa-untied": LlamaConfig(
            **COMMON, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        "llama3-tied-rope-scaling": LlamaConfig(
            **COMMON, num_key_value_heads=1, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            },
        ),
        "qwen2-tied": Qwen2Config(
            **COMMON, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False,
        ),
        "qwen3-tied-head-dim": Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=12, rope_theta=1000000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        ),
    }


def make(out: pathlib.Path):
    if out.exists():
        shutil.rmtree(out)
    for name, config in cases().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        with torch.no_grad():
            seen = set()
            for p in model.parameters():  # a tied matrix once
                if id(p) not in seen:
                    seen.add(id(p))
                    p.add_(torch.randn_like(p) * 0.1)
            logits = model(torch.tensor([TOKENS])).logits[0]
        directory = out / name
        model.save_pretrained(directory)
        (directory / "logits.json").write_text(json.dumps({
            "made_by": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "tokens": TOKENS,
            "logits": [[float(f"{v:.7g}") for v in row] for row in logits.tolist()],
        }) + "\n")
        print(f"{directory}: {sum(p.numel() for p in model.parameters())} parameters")


def generate(out: pathlib.Path):
    """`generate.json` in every case: `transformers`' greedy continuation of each prompt alone,
    checked equal to a batched, left-padded `generate` of them all."""
    for name in cases():
        directory = out / name
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        alone = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = model.generate(
                    torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS, pad_token_id=0,
                )[0, len(prompt):].tolist()
                alone.append(ids)
            width = max(map(len, PROMPTS))
            padded = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
            batched = model.generate(
                padded, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, pad_token_id=0,
            )[:, width:].tolist()
        assert batched == alone, f"{name}: batched {batched} != alone {alone}"
        (directory / "generate.json").write_text(json.dumps({
            "made_by": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "prompts": PROMPTS,
            "greedy": alone,
        }) + "\n")
        print(f"{directory}/generate.json")


def check_export(directory: str, tokens, against):
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    out = {
        "made_by": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "class": type(model).__name__,
        "tokens": tokens,
    }
    if against:
        want = torch.tensor(json.loads(pathlib.Path(against).read_text())["logits"])
        out["max_abs_diff"] = float((logits - want).abs().max())
    else:
        out["logits"] = logits.tolist()
    print(json.dumps(out))


def check_peft(base: str, adapters: str, merged: str, tokens):
    """PEFT's LoRA applied to `base` (its own implementation) against odc's merged export."""
    from peft import PeftModel

    ids = torch.tensor([tokens])
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(model, adapters).eval()(ids).logits[0]
        merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        merged_logits = merged_model(ids).logits[0]
        base_logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(ids).logits[0]
    import peft

    print(json.dumps({
        "made_by": f"peft {peft.__version__}, transformers {transformers.__version__}",
        "peft_vs_odc_merged_max_abs_diff": float((peft_logits - merged_logits).abs().max()),
        "adapters_moved_the_logits_by": float((peft_logits - base_logits).abs().max()),
    }))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent.parent / "tests/fixtures/hf"))
    parser.add_argument("--check-export")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--against", help="a logits.json to compare with (prints the max |diff|)")
    parser.add_argument("--generate", action="store_true",
                        help="add generate.json (greedy continuations) to the existing cases")
    parser.add_argument("--check-peft", nargs=3, metavar=("BASE", "ADAPTERS", "MERGED"),
                        help="PEFT applying odc's adapters to BASE vs odc's MERGED export")
    args = parser.parse_args()
    if args.generate:
        generate(pathlib.Path(args.out))
    elif args.check_peft:
        check_peft(*args.check_peft, [int(t) for t in args.tokens.split(",")])
    elif args.check_export:
        check_export(args.check_export, [int(t) for t in args.tokens.split(",")], args.against)
    else:
        make(pathlib.Path(args.out))
