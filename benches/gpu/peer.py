#!/usr/bin/env python3
"""The PyTorch peer of odc's GPU figures (issue 40, "Figures"): what a GPU user runs instead of
odc's `sft`, on the same model directory and the same GSM8K chat samples, plus the helpers
`benches/gpu/figures.sh` uses to read odc's logs and print its table.

    peer.py make-model --shape smollm2-135m|qwen2.5-0.5b|tiny|tiny-qwen --data TRAIN.jsonl --out DIR
    peer.py train --model-dir DIR --data TRAIN.jsonl --batch-size N --steps S --warmup W [--json OUT]
    peer.py odc-log LOG --warmup W [--peer-json J]      (what figures.sh reads from odc's output)
    peer.py report --runs RUNS.tsv [--gpu-name NAME]     (figures.sh's table)
    peer.py generate --model-dir DIR --prompts P.json --json OUT [--dtype bf16|f32]
    peer.py generate-report --odc A.json,B.json --peer C.json,D.json [--greedy-odc G --greedy-peer H]

generate: transformers' batched `generate` (left-padded prompts with their attention mask,
SDPA, `num_return_sequences`, sampling at the odc run's temperature and top-p with top-k off, its
stop ids as `eos_token_id`) on the prompts `odc-bench generate --prompts-out P.json` wrote (the
same token ids, GSM8K questions in the directory's chat template); `--rounds` timed rounds
between torch.cuda.synchronize() calls; a response's tokens counted as odc counts them (up to
and including its first stop id). At temperature 0 the responses go into the JSON (`greedy`).
generate-report: the sampled tokens/s of odc over the peer's (the mean of each side's best
rounds, ABBA runs), the peer/peer control, and the greedy responses compared token for token.

make-model: a Hugging Face directory with seeded RANDOM weights in a public model's shape
(benches/src/hf.rs's table: SmolLM2-135M as LlamaForCausalLM, Qwen2.5-0.5B as
Qwen2ForCausalLM; `tiny` and `tiny-qwen` for a CPU smoke test), stored as bf16 in
model.safetensors by default (`--dtype f32` for fp32; odc and transformers load both, and every
bf16 value is exact in the fp32 masters both sides train), config.json, generation_config.json,
and a byte-level BPE tokenizer trained with `tokenizers` on TRAIN.jsonl's questions and answers
(at most `--tokenizer-vocab` ids, at most the model's vocabulary) with the ChatML special tokens
`<|endoftext|>` (0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos) and Qwen2.5's chat template
(tests/fixtures/chat/qwen2.5/tokenizer_config.json).

train: PyTorch eager + transformers on the directory (AutoModelForCausalLM, SDPA attention),
fp32 master weights under AMP autocast bf16, fused AdamW, the samples odc's `sft --model-dir DIR
--data TRAIN.jsonl --batch-size N` takes, in its order (examples/sft/data.rs: records 0, 1, 2, ...
in file order, no shuffle, cycled; a record whose sample is longer than min(max_position_embeddings,
--token-budget 4096) skipped; N per step), each formatted as odc formats it (text/src/format.rs,
chat.rs, chat_sample.rs): the conversation [user: question, assistant: answer] rendered by the
directory's chat template (Qwen2.5's adds its default system prompt), encoded once with no special
token added, loss on the tokens inside the assistant's span (its content and its `<|im_end|>`,
not the header nor the newline after), the loss the mean over the step's loss tokens. odc's
optimizer settings (examples/sft/settings.rs and main.rs): lr 3e-3, warm-up 20 steps (at most
the run's steps) from 1/20, cosine to 0.1 of the peak, AdamW betas (0.9, 0.95), eps 1e-8, weight
decay 0.01 on every parameter, gradient norm clipped to 1.0.
Batching: the step's samples sorted by length and cut into micro-batches of at most
--micro-batch-tokens padded tokens (16384), each right-padded to its longest sample; without an
attention mask (`--attn-mask causal`, the default): right padding under a causal mask changes no
real token's output, so SDPA runs its causal kernels and the loss is exact (`--attn-mask padding`
passes the padding mask as a tokenizer's output would). Gradients of the micro-batches are summed.
Packing without cross-attention through position_ids makes transformers' SDPA path build a dense
block mask over the whole pack (quadratic in the pack), slower than this.
`--steps S` steps are timed after `--warmup W` untimed ones (W + S in all), each between
torch.cuda.synchronize() calls. Tokens are counted as odc counts them (policy/src/step/run.rs:
StepStats.tokens is the sum of the step's samples' lengths, prompt and answer, no padding).
MFU = 6 * N * tokens/s / peak, N every parameter once (a tied head is the embedding matrix, counted
once, as the head's matmul; the embedding lookup does no arithmetic), peak 989e12 for H100/H200
SXM dense bf16 (--peak-tflops overrides). Last line:
    result peer model=... problems_per_step=N ms_per_step=X tokens_per_s=Y mfu=Z loss_first=.. loss_last=..
"""

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QWEN_TEMPLATE_CONFIG = REPO / "tests" / "fixtures" / "chat" / "qwen2.5" / "tokenizer_config.json"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, EOS = "<|endoftext|>", "<|im_end|>"

# The public shapes, as benches/src/hf.rs's `shape` writes them (random weights, init_std 0.02).
SHAPES = {
    "smollm2-135m": dict(family="llama", vocab=49_152, hidden=576, layers=30, heads=9, kv_heads=3,
                         ff=1_536, max_pos=8_192, rope_theta=100_000.0, eps=1e-5, tied=True),
    "qwen2.5-0.5b": dict(family="qwen2", vocab=151_936, hidden=896, layers=24, heads=14,
                         kv_heads=2, ff=4_864, max_pos=32_768, rope_theta=1_000_000.0, eps=1e-6,
                         tied=True),
    # CPU smoke tests.
    "tiny": dict(family="llama", vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ff=128,
                 max_pos=2_048, rope_theta=10_000.0, eps=1e-5, tied=True),
    "tiny-qwen": dict(family="qwen2", vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ff=128,
                      max_pos=2_048, rope_theta=1_000_000.0, eps=1e-6, tied=True),
}

# Dense bf16 peaks (FLOP/s), by a substring of torch.cuda.get_device_name().
PEAKS = [("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def peak_of(gpu_name):
    """The dense bf16 peak of a GPU by name: 989e12 for H100 and H200 (SXM); None if unknown."""
    for key, peak in PEAKS:
        if key.lower() in (gpu_name or "").lower():
            return peak
    return None


def die(message):
    print(f"peer.py: {message}", file=sys.stderr)
    sys.exit(2)


# --- GSM8K and the chat format (odc-text) -------------------------------------------------


def load_gsm8k(path):
    """Every {"question", "answer"} record of a JSONL file, in order (blank lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if not isinstance(r.get("question"), str) or not isinstance(r.get("answer"), str):
                die(f"{path}:{n}: not a GSM8K record (question and answer strings)")
            records.append((r["question"], r["answer"]))
    if not records:
        die(f"{path}: no training records")
    return records


class ChatFormat:
    """A model directory's tokenizer and chat template, as odc's HfTokenizer and ChatTemplate read
    them: tokenizer.json; tokenizer_config.json's eos_token, bos_token and chat_template (or
    chat_template.jinja); generation_config.json's eos_token_id (stop ids)."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        config = json.loads((d / "tokenizer_config.json").read_text())
        generation = {}
        if (d / "generation_config.json").exists():
            generation = json.loads((d / "generation_config.json").read_text())
        token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        eos = token(config.get("eos_token"))
        eos_ids = generation.get("eos_token_id")
        eos_ids = [] if eos_ids is None else (eos_ids if isinstance(eos_ids, list) else [eos_ids])
        if eos is None:
            eos = self.tokenizer.id_to_token(eos_ids[0]) if eos_ids else None
        if eos is None:
            eos = next((n for n in ["<|endoftext|>", "</s>", "<eos>", "<|im_end|>"]
                        if self.tokenizer.token_to_id(n) is not None), None)
        if eos is None or self.tokenizer.token_to_id(eos) is None:
            die(f"{d}: no end-of-sequence token")
        self.stop_texts = [eos]
        for i in eos_ids:
            t = self.tokenizer.id_to_token(i)
            if t is not None and t not in self.stop_texts:
                self.stop_texts.append(t)
        bos = config["bos_token"] if "bos_token" in config else None
        bos = token(bos)
        jinja = d / "chat_template.jinja"
        source = jinja.read_text() if jinja.exists() else config.get("chat_template")
        if isinstance(source, list):
            source = next(t["template"] for t in source if t.get("name") == "default")
        if not source:
            die(f"{d}: no chat_template")
        self.template = compile_template(source)
        self.template_vars = {"eos_token": eos}
        if bos is not None:
            self.template_vars["bos_token"] = bos

    def render(self, messages, add_generation_prompt):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.template_vars)

    def sample(self, question, answer):
        """(ids, loss mask) of a problem as odc's Sample::from_chat makes it."""
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]
        text = self.render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], True)
            through = self.render(messages[: i + 1], False)
            if not through.startswith(before) or not text.startswith(through):
                die("the chat template renders earlier turns differently as the conversation grows")
            turn = through[len(before):]
            ends = [turn.rfind(s) + len(s) for s in self.stop_texts if s and turn.rfind(s) >= 0]
            spans.append((len(before), len(before) + (max(ends) if ends else len(turn))))
        # Offsets are character offsets in Python's tokenizers (byte offsets in Rust's): the same
        # tokens fall inside the same spans.
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        mask = [any(s <= a and b <= e and a < e for s, e in spans) for a, b in enc.offsets]
        return list(enc.ids), mask


def compile_template(source):
    """The template in Jinja2 set up as transformers sets it up (what odc's minijinja matches)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise RuntimeError(f"raise_exception: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return time.strftime(fmt, time.gmtime())

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def odc_minibatches(fmt, records, batch, steps, max_len):
    """The first `steps` minibatches odc's next_minibatch takes: record indices from 0, cycled,
    each sample longer than max_len skipped. Each: a list of (index, ids, mask)."""
    out, index, cache = [], 0, {}
    for _ in range(steps):
        step, skipped = [], 0
        while len(step) < batch:
            i = index % len(records)
            index += 1
            if i not in cache:
                cache[i] = fmt.sample(*records[i])
            ids, mask = cache[i]
            if len(ids) > max_len:
                skipped += 1
                if skipped > 100 * batch:
                    die(f"no record near index {index - 1} fits {max_len} tokens")
                continue
            step.append((index - 1, ids, mask))
        out.append(step)
    return out


def lr_factor(step, warmup, total, min_ratio):
    """odc's LrSchedule::WarmupCosine (policy/src/schedule.rs), step 0-based."""
    m = min(max(min_ratio, 0.0), 1.0)
    if step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 0)
    p = 1.0 if span == 0 else min((step - warmup) / span, 1.0)
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))


def param_count(shape):
    """Parameters of a shape, each once (a tied head is the embedding)."""
    d, hd = shape["hidden"], shape["hidden"] // shape["heads"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    bias = shape["family"] == "qwen2"
    layer = d * q + 2 * d * kv + q * d + 3 * d * shape["ff"] + 2 * d
    if bias:
        layer += q + 2 * kv
    head = 0 if shape["tied"] else shape["vocab"] * d
    return shape["vocab"] * d + shape["layers"] * layer + d + head


# --- make-model ---------------------------------------------------------------------------------


def train_tokenizer(records, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = (t for q, a in records for t in (q, a))
    tok.train_from_iterator(texts, trainer=trainer, length=2 * len(records))
    return tok


def model_config(shape, ids, dtype_name):
    fam = shape["family"]
    config = {
        "architectures": ["LlamaForCausalLM" if fam == "llama" else "Qwen2ForCausalLM"],
        "model_type": fam,
        "hidden_act": "silu",
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["ff"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "num_hidden_layers": shape["layers"],
        "head_dim": shape["hidden"] // shape["heads"],
        "vocab_size": shape["vocab"],
        "max_position_embeddings": shape["max_pos"],
        "rms_norm_eps": shape["eps"],
        "rope_theta": shape["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"]},
        "tie_word_embeddings": shape["tied"],
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": ids[PAD],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if fam == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, max_window_layers=shape["layers"])
    return config


def random_weights(shape, seed, dtype):
    """Seeded N(0, 0.02) matrices, unit norms, zero biases, under transformers' names."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, hd = shape["hidden"], shape["hidden"] // shape["heads"]
    q, kv, ff = shape["heads"] * hd, shape["kv_heads"] * hd, shape["ff"]

    def normal(*dims):
        return (torch.randn(*dims, generator=g) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": normal(shape["vocab"], d)}
    for layer in range(shape["layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(d, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = normal(q, d)
        w[p + "self_attn.k_proj.weight"] = normal(kv, d)
        w[p + "self_attn.v_proj.weight"] = normal(kv, d)
        w[p + "self_attn.o_proj.weight"] = normal(d, q)
        if shape["family"] == "qwen2":
            w[p + "self_attn.q_proj.bias"] = torch.zeros(q, dtype=dtype)
            w[p + "self_attn.k_proj.bias"] = torch.zeros(kv, dtype=dtype)
            w[p + "self_attn.v_proj.bias"] = torch.zeros(kv, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=dtype)
        w[p + "mlp.gate_proj.weight"] = normal(ff, d)
        w[p + "mlp.up_proj.weight"] = normal(ff, d)
        w[p + "mlp.down_proj.weight"] = normal(d, ff)
    w["model.norm.weight"] = torch.ones(d, dtype=dtype)
    if not shape["tied"]:
        w["lm_head.weight"] = normal(shape["vocab"], d)
    return w


def make_model(args):
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    started = time.time()
    shape = SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from:
        tok = Tokenizer.from_file(str(Path(args.tokenizer_from) / "tokenizer.json"))
        how = f"copied from {args.tokenizer_from}"
    else:
        records = load_gsm8k(args.data)
        vocab = min(args.tokenizer_vocab or (512 if shape["vocab"] <= 4096 else 16_384),
                    shape["vocab"])
        tok = train_tokenizer(records, vocab)
        how = f"BPE trained on {len(records)} problems of {args.data}"
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    if any(i is None for i in ids.values()):
        die(f"the tokenizer lacks a special token: {ids}")
    tok_vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if tok_vocab > shape["vocab"]:
        die(f"the tokenizer's {tok_vocab} ids exceed the model's vocabulary {shape['vocab']}")
    tok.save(str(out / "tokenizer.json"))

    template = json.loads(QWEN_TEMPLATE_CONFIG.read_text())["chat_template"]
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for s in SPECIALS}
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "errors": "replace",
        "model_max_length": shape["max_pos"],
        "pad_token": PAD,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"eos_token_id": [ids[EOS], ids[PAD]], "pad_token_id": ids[PAD],
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    dtype, dtype_name = ((torch.bfloat16, "bfloat16") if args.dtype == "bf16"
                         else (torch.float32, "float32"))
    config = model_config(shape, ids, dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    weights = random_weights(shape, args.seed, dtype)
    params = sum(t.numel() for t in weights.values())
    assert params == param_count(shape), (params, param_count(shape))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"make-model: {out}: {config['architectures'][0]} in the {args.shape} shape, "
          f"{params} parameters ({args.dtype}, seed {args.seed}); tokenizer {how}, "
          f"{tok_vocab} ids; {time.time() - started:.1f} s")
    print(f"result make-model shape={args.shape} params={params} dtype={args.dtype} "
          f"tokenizer_vocab={tok_vocab} model_vocab={shape['vocab']} dir={out}")


# --- train --------------------------------------------------------------------------------------


def train(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    started = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    max_pos = config.get("max_position_embeddings",
                         2048 if config.get("model_type") == "llama" else 32_768)
    max_len = min(max_pos, args.token_budget)
    fmt = ChatFormat(args.model_dir)
    records = load_gsm8k(args.data)
    total = args.warmup + args.steps
    counted = odc_minibatches(fmt, records, args.batch_size, max(total, args.count_steps),
                              max_len)
    steps = counted[:total]
    prepared = time.time() - started

    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model, info = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                         "mismatched_keys")}
    if bad:
        die(f"{args.model_dir}: transformers loaded it with {bad}")
    model.to(device)
    model.train()
    model.config.use_cache = False
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)  # tied: the embedding once
    try:
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=args.weight_decay, fused=True)
        fused = True
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=args.weight_decay, foreach=True)
        fused = False
    lr_warmup = min(args.lr_warmup_steps, total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, lr_warmup, total, args.min_lr_ratio))
    amp = args.amp == "bf16"
    pad_id = fmt.tokenizer.token_to_id(PAD)
    gpu_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_of(gpu_name)

    def micro_batches(step):
        """The step's samples sorted by length, cut at --micro-batch-tokens padded tokens."""
        order = sorted(step, key=lambda s: len(s[1]))
        out, cur = [], []
        for s in order:
            if cur and (len(cur) + 1) * len(s[1]) > args.micro_batch_tokens:
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
        return out

    def tensors(mb):
        width = max(len(s[1]) for s in mb)
        ids = torch.full((len(mb), width), pad_id, dtype=torch.long)
        labels = torch.full((len(mb), width), -100, dtype=torch.long)
        attn = torch.zeros((len(mb), width), dtype=torch.long)
        for r, (_, tok, mask) in enumerate(mb):
            n = len(tok)
            ids[r, :n] = torch.tensor(tok)
            labels[r, :n] = torch.tensor([t if m else -100 for t, m in zip(tok, mask)])
            attn[r, :n] = 1
        if cuda:
            ids, labels, attn = (t.pin_memory().to(device, non_blocking=True)
                                 for t in (ids, labels, attn))
        return ids, labels, attn, len(mb) * width

    def one_step(step):
        loss_tokens = sum(sum(s[2][1:]) for s in step)  # a sample's first token is no target
        total_loss = torch.zeros((), device=device)
        padded = 0
        mbs = micro_batches(step)
        for mb in mbs:
            ids, labels, attn, width = tensors(mb)
            padded += width
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=ids,
                               attention_mask=attn if args.attn_mask == "padding" else None
                               ).logits
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100,
                                   reduction="sum") / loss_tokens
            loss.backward()
            total_loss += loss.detach()
            del logits, loss
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return total_loss.item(), len(mbs), padded

    log, timed_ms, timed_tokens = [], [], 0
    for k, step in enumerate(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, mbs, padded = one_step(step)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        tokens = sum(len(s[1]) for s in step)
        timed = k >= args.warmup
        if timed:
            timed_ms.append(ms)
            timed_tokens += tokens
        log.append(dict(step=k + 1, ms=ms, tokens=tokens, loss=loss, micro_batches=mbs,
                        padded_tokens=padded, timed=timed,
                        first_index=step[0][0], last_index=step[-1][0]))
        print(f"peer step {k + 1}/{total} {'timed' if timed else 'warm-up'}: loss {loss:.4f}  "
              f"{ms:.1f} ms  {tokens} tokens ({padded} padded, {mbs} micro-batches)", flush=True)
        if not math.isfinite(loss):
            die(f"step {k + 1}: the loss is {loss}")
    if not timed_ms:
        die("no timed step: --steps must be at least 1")
    ms_per_step = sum(timed_ms) / len(timed_ms)
    tps = timed_tokens / (sum(timed_ms) / 1e3)
    mfu = 6 * n_params * tps / peak if peak else float("nan")
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    name = Path(args.model_dir).name
    result = dict(
        model=name, device=str(device), gpu=gpu_name, problems_per_step=args.batch_size,
        steps=args.steps, warmup=args.warmup, ms_per_step=ms_per_step, tokens_per_s=tps,
        mfu=mfu, params=n_params, peak_flops=peak, loss_first=log[0]["loss"],
        loss_last=log[-1]["loss"], tokens_per_step=timed_tokens / len(timed_ms),
        padded_per_step=sum(r["padded_tokens"] for r in log if r["timed"]) / len(timed_ms),
        micro_batches=log[-1]["micro_batches"], amp=args.amp, attn_mask=args.attn_mask,
        fused_adamw=fused, max_len=max_len,
        step_tokens=[sum(len(s[1]) for s in step) for step in counted],
        steps_log=log, setup_s=prepared, wall_s=time.time() - started, max_memory_gib=mem,
        torch=torch.__version__, transformers=__import__("transformers").__version__)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"peer: {name} on {gpu_name}: {n_params} parameters, AMP {args.amp}, SDPA "
          f"({args.attn_mask} mask), {'fused' if fused else 'foreach'} AdamW; "
          f"{args.steps} steps timed after {args.warmup}; {result['tokens_per_step']:.0f} tokens "
          f"a step ({result['padded_per_step']:.0f} padded, {result['micro_batches']} "
          f"micro-batches); peak {'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown'}; "
          f"max memory {mem:.1f} GiB; {result['wall_s']:.1f} s in all")
    print(f"result peer model={name} problems_per_step={args.batch_size} "
          f"ms_per_step={ms_per_step:.1f} tokens_per_s={tps:.0f} mfu={mfu:.4f} "
          f"loss_first={result['loss_first']:.4f} loss_last={result['loss_last']:.4f} "
          f"params={n_params} tokens_per_step={result['tokens_per_step']:.0f} "
          f"micro_batches={result['micro_batches']} device={device.type}")


# --- odc's logs and the figures table -------------------------------------------------------------


def odc_log(path, warmup, peer_json=None):
    """What an odc `sft` log says about its steps, the first `warmup` excluded.

    Preferred: one `step-stats step=K wall_ms=X tokens=T ...` line per step (exact). Otherwise the
    lines odc prints today: `step    K/S  loss L  grad-norm G  R tok/s  M ms/step` (steps 1, every
    10th and the last) and `N steps in X s: Y tokens/s`; then only step 1 can be excluded, its
    tokens taken from the peer's log of the same samples (else estimated from R and M)."""
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    out = dict(method=None, note="")
    m = re.search(r"^sft: (\d+) parameters.*?(\d+) trainers, (\d+) servers", text, re.M)
    if m:
        out.update(params=int(m.group(1)), trainers=int(m.group(2)), servers=int(m.group(3)))
    phases = re.search(r"^phases \(all trainers, all steps\): (.*)$", text, re.M)
    if phases:
        out["phases"] = phases.group(1)
    stage = re.findall(r"^host staging: (\d+) bytes in (\d+) steps", text, re.M)
    if stage:
        b, s = (sum(int(x[0]) for x in stage), max(int(x[1]) for x in stage))
        out.update(staging_bytes=b, staging_steps=s, staging_per_step=b / max(s, 1))
    peer_tokens = None
    if peer_json and Path(peer_json).exists():
        peer_tokens = json.loads(Path(peer_json).read_text()).get("step_tokens")
    stats = {}
    for line in re.findall(r"^step-stats (.*)$", text, re.M):
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        try:
            stats[int(f["step"])] = dict(ms=float(f["wall_ms"]), tokens=int(f["tokens"]),
                                         loss=float(f["loss"]) if "loss" in f else None)
        except (KeyError, ValueError):
            continue
    lines = {int(k): dict(loss=float(loss), rate=float(rate), ms=float(ms))
             for k, loss, rate, ms in re.findall(
                 r"^step +(\d+)/\d+ +loss ([-+0-9.eE]+|NaN|inf) .*? ([0-9.]+) tok/s +([0-9.]+) ms/step",
                 text, re.M)}
    m = re.search(r"^(\d+) steps in ([0-9.]+) s: ([0-9.]+) tokens/s", text, re.M)
    out["losses"] = {k: s["loss"] for k, s in stats.items() if s["loss"] is not None}
    if 1 in stats:
        out["loss_first"] = stats[1]["loss"]
    elif 1 in lines:
        out["loss_first"] = lines[1]["loss"]
    timed = [stats[k] for k in sorted(stats) if k > warmup]
    if timed:
        ms = sum(s["ms"] for s in timed)
        out.update(method="exact", steps=len(timed), ms_per_step=ms / len(timed),
                   tokens_per_s=sum(s["tokens"] for s in timed) / (ms / 1e3),
                   tokens_per_step=sum(s["tokens"] for s in timed) / len(timed))
        if peer_tokens:
            same = all(peer_tokens[k - 1] == stats[k]["tokens"] for k in stats
                       if k - 1 < len(peer_tokens))
            out["note"] = ("tokens per step = the peer's" if same
                           else "tokens per step differ from the peer's: not the same samples")
        return out
    if m and 1 in lines:
        n, secs, rate = int(m.group(1)), float(m.group(2)), float(m.group(3))
        if n < 2:
            out["note"] = "one step only: nothing left after the warm-up step"
            return out
        wall1 = lines[1]["ms"] / 1e3
        if peer_tokens and len(peer_tokens) >= n:
            total, first = sum(peer_tokens[:n]), peer_tokens[0]
            check = total / (rate * secs) - 1 if rate * secs else float("nan")
            how = f"tokens from the peer's samples ({check:+.1%} vs odc's rate x time)"
        else:
            total, first = rate * secs, lines[1]["rate"] * wall1
            how = "tokens estimated from odc's rounded rates"
        out.update(method="approx", steps=n - 1, ms_per_step=(secs - wall1) * 1e3 / (n - 1),
                   tokens_per_s=(total - first) / (secs - wall1),
                   tokens_per_step=(total - first) / (n - 1))
        out["note"] = (f"no per-step lines: step 1 excluded{' only' if warmup > 1 else ''}, "
                       f"the rest from '{n} steps in {secs} s'; {how}")
    return out


def loss_curve(odc_losses, peer_log):
    """(the largest relative difference of odc's step losses from the peer's, its step, the steps
    compared) over the steps both logged, or None when they share none."""
    peer = {int(r["step"]): float(r["loss"]) for r in peer_log if "loss" in r}
    common = sorted(k for k in odc_losses if k in peer and peer[k] != 0)
    if not common:
        return None
    diffs = [(odc_losses[k] / peer[k] - 1, k) for k in common]
    worst, at = max(diffs, key=lambda d: abs(d[0]))
    return worst, at, len(common)


def report(args):
    """figures.sh's table from its runs file (key, kind, shape, batch, warmup, rc, secs, log,
    json, note: one run a line, tab-separated)."""
    runs = []
    for line in Path(args.runs).read_text().splitlines():
        if not line.strip():
            continue
        f = line.split("\t")
        f += [""] * (10 - len(f))
        runs.append(dict(key=f[0], kind=f[1], shape=f[2], batch=f[3], warmup=int(f[4] or 0),
                         rc=int(f[5]) if f[5].lstrip("-").isdigit() else None,
                         secs=f[6], log=f[7], json=f[8], note=f[9]))
    peak = peak_of(args.gpu_name)
    peak_note = (f"peak {peak / 1e12:.0f} TFLOP/s ({args.gpu_name})" if peak
                 else f"no known peak for {args.gpu_name or 'this device'}")
    rows = []  # (figure, value, target, verdict, details)

    def row(figure, value, target="", verdict="", details=""):
        rows.append((figure, value, target, verdict, details))

    def failed(r):
        if r["rc"] is None:
            return r["note"] or "not run"
        if r["rc"] in (124, 137):
            return f"cut at its time limit{(': ' + r['note']) if r['note'] else ''}; log {r['log']}"
        if r["rc"] != 0:
            said = ""
            if r["log"] and Path(r["log"]).exists():
                hits = [l for l in Path(r["log"]).read_text(errors="replace").splitlines()
                        if re.search(r"error|panicked|Traceback|peer.py:", l, re.I)]
                said = hits[-1][:160] if hits else ""
            return f"exit {r['rc']}{(': ' + said) if said else ''}; log {r['log']}"
        return None

    def peer_result(r):
        if failed(r) or not r["json"] or not Path(r["json"]).exists():
            return None
        return json.loads(Path(r["json"]).read_text())

    def lost(all_runs, ok):
        """'; KEY left out: why' for each run of a row that gave no figure."""
        done = {id(r) for r, _ in ok}
        return "".join(f"; {r['key'].split('.')[-1]} left out: "
                       f"{failed(r) or r['note'] or 'no figure'}"
                       for r in all_runs if id(r) not in done)

    def mfu(params, tps):
        return f"MFU {100 * 6 * params * tps / peak:.2f}%" if peak and params else "MFU ?"

    params_of = {}
    for r in runs:
        if r["kind"] == "make" and not failed(r):
            m = re.search(r"params=(\d+)", Path(r["log"]).read_text(errors="replace"))
            if m:
                params_of[r["shape"]] = int(m.group(1))
    staging = []
    groups = []
    for r in runs:
        g = (r["shape"], r["batch"], r["kind"] in ("launch", "peer-launch"))
        if r["kind"] in ("peer", "odc", "launch", "peer-launch") and g not in groups:
            groups.append(g)
    for shape, batch, launched in groups:
        kinds = ("launch", "peer-launch") if launched else ("odc", "peer")
        group = [r for r in runs if (r["shape"], r["batch"]) == (shape, batch)
                 and r["kind"] in kinds]
        label = f"{shape} x{batch}"
        params = params_of.get(shape)
        make = next((r for r in runs if r["kind"] == "make" and r["shape"] == shape), None)
        if make and failed(make):
            row(f"{label}: model directory", "not made", "", "FAIL", failed(make))
        peers = [r for r in group if r["kind"] in ("peer", "peer-launch")]
        odcs = [r for r in group if r["kind"] in ("odc", "launch")]
        peer_ok = [(r, p) for r in peers if (p := peer_result(r))]
        peer_json = next((r["json"] for r, _ in peer_ok), None)
        odc_ok = []
        for r in odcs:
            if failed(r):
                continue
            o = odc_log(r["log"], r["warmup"], peer_json)
            if o.get("staging_bytes") is not None:
                staging.append((r["key"], o["staging_per_step"], o["staging_steps"]))
            else:
                staging.append((r["key"], None, 0))
            if o.get("ms_per_step"):
                odc_ok.append((r, o))
            else:
                r["note"] = "its log has no step timing" + (f" ({o['note']})" if o["note"] else "")
        if not params:
            params = next((o["params"] for _, o in odc_ok if o.get("params")), None) or next(
                (p["params"] for _, p in peer_ok), None)
        what = ("odc launch --nprocs 2 --transport cuda" if launched
                else "odc sft --device cuda (1 process)")
        if odc_ok:
            ms = sum(o["ms_per_step"] for _, o in odc_ok) / len(odc_ok)
            tps = sum(o["tokens_per_s"] for _, o in odc_ok) / len(odc_ok)
            each = ", ".join(f"{o['ms_per_step']:.0f}" for _, o in odc_ok)
            o0 = odc_ok[0][1]
            row(f"{label}: {what}", f"{ms:.0f} ms/step", "", "",
                f"{tps:,.0f} tokens/s, {mfu(params, tps)}; run(s) {each} ms; "
                f"{o0.get('trainers', '?')} trainers, {o0.get('servers', '?')} servers; "
                f"{o0['steps']} steps timed after {odc_ok[0][0]['warmup']}; first loss "
                f"{o0.get('loss_first', float('nan')):.4f}; {o0['method']}"
                f"{('; ' + o0['note']) if o0['note'] else ''}{lost(odcs, odc_ok)}")
        else:
            why = "; ".join(dict.fromkeys(failed(r) or r["note"] or "no timing" for r in odcs)) or "not run"
            row(f"{label}: {what}", "not run", "", "FAIL", why)
        if peer_ok:
            ms = sum(p["ms_per_step"] for _, p in peer_ok) / len(peer_ok)
            ptps = sum(p["tokens_per_s"] for _, p in peer_ok) / len(peer_ok)
            p0 = peer_ok[0][1]
            each = ", ".join(f"{p['ms_per_step']:.0f}" for _, p in peer_ok)
            row(f"{label}: PyTorch eager peer", f"{ms:.0f} ms/step", "", "",
                f"{ptps:,.0f} tokens/s, {mfu(params or p0['params'], ptps)}; run(s) {each} ms; "
                f"{p0['steps']} steps timed after {p0['warmup']}; first loss "
                f"{p0['loss_first']:.4f}; AMP {p0['amp']}, SDPA, fused AdamW {p0['fused_adamw']}, "
                f"{p0['micro_batches']} micro-batch(es) of {p0['padded_per_step']:.0f} padded "
                f"tokens; torch {p0['torch']}, transformers {p0['transformers']}"
                f"{lost(peers, peer_ok)}")
        else:
            why = "; ".join(dict.fromkeys(failed(r) or "no result" for r in peers)) or "not run"
            row(f"{label}: PyTorch eager peer", "not run", "", "FAIL", why)
        if odc_ok and peer_ok:
            tps = sum(o["tokens_per_s"] for _, o in odc_ok) / len(odc_ok)
            ptps = sum(p["tokens_per_s"] for _, p in peer_ok) / len(peer_ok)
            ms = sum(o["ms_per_step"] for _, o in odc_ok) / len(odc_ok)
            pms = sum(p["ms_per_step"] for _, p in peer_ok) / len(peer_ok)
            row(f"{label}: odc / peer (tokens/s)", f"{tps / ptps:.2f}x", "> 1 (part 2)", "",
                f"time per step {ms / pms:.2f}x the peer's; order "
                f"{' '.join(r['key'].split('.')[-1] for r in group)}")
            first = [o.get("loss_first") for _, o in odc_ok if o.get("loss_first") is not None]
            if first:
                rel = first[0] / peer_ok[0][1]["loss_first"] - 1
                row(f"{label}: first loss, odc vs peer", f"{rel:+.2%}", "within 1% (bf16)",
                    "ok" if abs(rel) <= 0.01 else "FAIL",
                    f"odc {first[0]:.4f}, peer {peer_ok[0][1]['loss_first']:.4f}: same weights, "
                    f"samples and loss mask")
        if odc_ok and odc_ok[0][1].get("phases"):
            row(f"{label}: where odc's step goes", "", "", "",
                f"sum over trainers and steps: {odc_ok[0][1]['phases']} ({odc_ok[0][0]['key']})")
        fused = [r for r in runs if (r["shape"], r["batch"]) == (shape, batch)
                 and r["kind"] == "odc-fused" and not launched]
        for r in fused:
            o = None if failed(r) else odc_log(r["log"], r["warmup"], peer_json)
            if not o or not o.get("ms_per_step"):
                row(f"{label}: odc with ODC_FUSED_KERNELS=1", "not run", "", "FAIL",
                    failed(r) or "its log has no step timing")
                continue
            row(f"{label}: odc with ODC_FUSED_KERNELS=1", f"{o['ms_per_step']:.0f} ms/step", "", "",
                f"{o['tokens_per_s']:,.0f} tokens/s, {mfu(params, o['tokens_per_s'])}; "
                f"{o.get('phases', 'no phases line')}")
            if peer_ok:
                ptps = sum(p["tokens_per_s"] for _, p in peer_ok) / len(peer_ok)
                row(f"{label}: odc fused / peer (tokens/s)", f"{o['tokens_per_s'] / ptps:.2f}x",
                    ">= 1.0x, reach for 2x (part 2)", "",
                    "one run after the ABBA against the peer runs' mean (no control of its own)")
                if o.get("loss_first") is not None:
                    rel = o["loss_first"] / peer_ok[0][1]["loss_first"] - 1
                    row(f"{label}: first loss, odc fused vs peer", f"{rel:+.2%}",
                        "within 1% (bf16)", "ok" if abs(rel) <= 0.01 else "FAIL",
                        f"odc {o['loss_first']:.4f}, peer {peer_ok[0][1]['loss_first']:.4f}")
            if peer_ok and o.get("losses"):
                curve = loss_curve(o["losses"], peer_ok[0][1].get("steps_log", []))
                if curve:
                    worst, at, n = curve
                    row(f"{label}: loss curve, odc fused vs peer", f"{worst:+.2%} at step {at}",
                        "within 2% over 20 steps (part 2)", "ok" if abs(worst) <= 0.02 else "FAIL",
                        f"the largest relative difference over the {n} steps both ran (the same "
                        f"samples, order and learning-rate schedule)")
            if odc_ok:
                tps = sum(x["tokens_per_s"] for _, x in odc_ok) / len(odc_ok)
                row(f"{label}: fused kernels / candle's ops (tokens/s)",
                    f"{o['tokens_per_s'] / tps:.2f}x", "> 1", "",
                    "the same samples and settings; only ODC_FUSED_KERNELS differs")
        hosts = [r for r in runs if (r["shape"], r["batch"]) == (shape, batch)
                 and r["kind"] == "odc-host" and not launched]
        for r in hosts:
            o = None if failed(r) else odc_log(r["log"], r["warmup"], peer_json)
            if not o or not o.get("ms_per_step"):
                row(f"{label}: odc --host-transfers (the path before)", "not run", "", "FAIL",
                    failed(r) or "its log has no step timing")
                continue
            staged = o.get("staging_per_step")
            row(f"{label}: odc --host-transfers (the path before)", f"{o['ms_per_step']:.0f} ms/step",
                "", "", f"{o['tokens_per_s']:,.0f} tokens/s, {mfu(params, o['tokens_per_s'])}; host "
                f"staging {staged if staged is None else f'{staged:,.0f}'} bytes/step; "
                f"{o.get('phases', 'no phases line')}")
            if odc_ok:
                tps = sum(x["tokens_per_s"] for _, x in odc_ok) / len(odc_ok)
                row(f"{label}: device path / host path (tokens/s)",
                    f"{tps / o['tokens_per_s']:.2f}x", "> 1", "",
                    "the same samples and settings; only --host-transfers differs")
        if len(peer_ok) >= 2:
            c = peer_ok[0][1]["ms_per_step"] / peer_ok[-1][1]["ms_per_step"]
            row(f"{label}: control peer / peer", f"{c:.2f}", "1.00 +- 5%",
                "ok" if abs(c - 1) <= 0.05 else "FAIL", "ms/step of the first peer run / the last")
        elif len(peers) >= 2:
            row(f"{label}: control peer / peer", "not run", "1.00 +- 5%", "FAIL",
                "; ".join(dict.fromkeys(failed(r) or "no result" for r in peers)))
    for shape in dict.fromkeys(r["shape"] for r in runs if r["kind"] == "odc-f32"):
        odc = next(r for r in runs if r["kind"] == "odc-f32" and r["shape"] == shape)
        peer = next((r for r in runs if r["kind"] == "peer-f32" and r["shape"] == shape), None)
        p = peer_result(peer) if peer else None
        o = None if failed(odc) else odc_log(odc["log"], 0)
        if not p or not o or o.get("loss_first") is None:
            why = "; ".join(x for x in (failed(odc), peer and failed(peer)) if x) or "no first loss"
            row(f"{shape}: first loss in fp32, odc vs transformers", "not run", "within 1e-4",
                "FAIL", why)
            continue
        rel = o["loss_first"] / p["loss_first"] - 1
        row(f"{shape}: first loss in fp32, odc vs transformers", f"{rel:+.2e}", "within 1e-4",
            "ok" if abs(rel) <= 1e-4 else "FAIL",
            f"odc {o['loss_first']:.7f} (--precision f32), peer {p['loss_first']:.7f} (no autocast)")
    for r in runs:
        if r["kind"] != "sft-overhead":
            continue
        text = Path(r["log"]).read_text(errors="replace") if r["log"] and Path(r["log"]).exists() else ""
        m = re.search(r"^result sft-overhead (.*)$", text, re.M)
        if failed(r) or not m:
            row("odc / candle alone (sft-overhead)", "not run", "<= 1.10", "FAIL",
                failed(r) or f"no result line; log {r['log']}")
            continue
        f = dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
        ratio, control = float(f["ratio"]), float(f["control"])
        # A control off 1.00 means the machine's noise, not odc, decides the ratio.
        verdict = ("NOISE" if abs(control - 1) > 0.05
                   else "met" if ratio <= 1.10 else "MISSED")
        row("odc / candle alone (sft-overhead)", f"{ratio:.2f}", "<= 1.10", verdict,
            f"{f.get('model', '?')}: candle {f.get('candle_tokens_per_s')} tokens/s, odc "
            f"{f.get('odc_tokens_per_s')} tokens/s (its MFU {f.get('candle_mfu')} / "
            f"{f.get('odc_mfu')} counts attention and not the tied head); log {r['log']}")
        row("sft-overhead control (candle / candle)", f"{control:.2f}", "1.00 +- 5%",
            "ok" if abs(control - 1) <= 0.05 else "FAIL", "")
    if staging:
        seen = [(k, b, s) for k, b, s in staging if b is not None]
        if seen:
            worst = max(b for _, b, _ in seen)
            missing = [k for k, b, _ in staging if b is None]
            row("host staging bytes per step (odc)", f"{worst:.0f}", "0",
                "met" if worst == 0 and not missing else "MISSED",
                "; ".join(f"{k} {b:.0f} ({s} steps)" for k, b, s in seen)
                + (f"; no 'host staging' line in {', '.join(missing)}" if missing else ""))
        else:
            row("host staging bytes per step (odc)", "not printed", "0", "FAIL",
                "no odc log has a 'host staging: B bytes in S steps' line")
    else:
        row("host staging bytes per step (odc)", "not run", "0", "FAIL", "no odc run finished")

    widths = [max(len(r[i]) for r in rows + [("figure", "value", "target", "verdict", "")])
              for i in range(4)]
    widths[0] = min(widths[0], 58)
    lines = [f"# odc figures (issue 40) on {args.gpu_name or '?'}; MFU = 6 N tokens/s / peak, "
             f"N every parameter once (tied head once); {peak_note}"]
    head = ("figure", "value", "target", "verdict", "details")
    for r in [head, tuple("-" * w for w in widths) + ("-------",)] + rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:4])) + "  " + r[4])
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if any(r[3] == "FAIL" for r in rows) else 0


# --- generate -----------------------------------------------------------------------------------


def generate(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(args.prompts).read_text())
    prompts, stop, samples = spec["prompts"], spec["stop"], spec["samples"]
    temperature, top_p = spec["temperature"], spec["top_p"]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    pad = stop[0] if stop else 0
    batch = args.decode_batch or len(prompts)
    options = dict(max_new_tokens=spec["max_new_tokens"], eos_token_id=stop or None,
                   pad_token_id=pad, num_return_sequences=samples, do_sample=temperature > 0)
    if temperature > 0:
        options.update(temperature=temperature, top_p=top_p, top_k=0)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rounds, responses = [], []
    for r in range(args.rounds):
        torch.manual_seed(args.seed)
        sync()
        started = time.time()
        responses = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(q)) + q for q in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in chunk],
                                device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, **options)[:, width:].tolist()
            for row in out:
                n = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
                responses.append(row[:n])
        sync()
        secs = time.time() - started
        tokens = sum(map(len, responses))
        rounds.append({"tokens": tokens, "seconds": secs})
        print(f"peer generate: round {r + 1}: {len(prompts)} prompts x {samples} samples, "
              f"{tokens} tokens in {secs:.2f} s: {tokens / secs:.0f} tokens/s ({args.dtype})")
    result = {"model_dir": args.model_dir, "device": device, "dtype": args.dtype,
              "prompts": len(prompts), "samples": samples, "decode_batch": batch,
              "rounds": rounds}
    if temperature == 0:
        result["greedy"] = responses
    Path(args.json).write_text(json.dumps(result) + "\n")


def best_rate(path):
    """The best round's tokens/s of a generate JSON (odc's or the peer's); None when unreadable."""
    try:
        rounds = json.loads(Path(path).read_text())["rounds"]
        return max(r["tokens"] / r["seconds"] for r in rounds if r["seconds"] > 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def generate_report(args):
    odc = [best_rate(p) for p in args.odc.split(",") if p]
    peer = [best_rate(p) for p in args.peer.split(",") if p]
    mean = lambda xs: sum(xs) / len(xs)
    lines = []
    if odc and peer and None not in odc + peer:
        lines.append(f"sampled tokens/s, odc / transformers generate: {mean(odc) / mean(peer):.2f}x "
                     f"(odc {mean(odc):.0f}, peer {mean(peer):.0f}; target >= 2x)")
        if len(peer) >= 2:
            lines.append(f"control peer / peer: {peer[-1] / peer[0]:.2f}")
    else:
        lines.append(f"sampled tokens/s: not measured (odc {odc}, peer {peer})")
    try:
        r = json.loads(Path(args.odc.split(",")[0]).read_text())
        lines.append(f"odc's KV cache at its largest: {r['peak_cache_bytes'] / 1e6:.1f} MB for "
                     f"{r['tokens_at_peak']} tokens, {r['peak_cache_bytes'] / max(1, r['analytical_cache_bytes']):.2f}x "
                     f"the analytical {r['analytical_cache_bytes'] / 1e6:.1f} MB")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    if args.greedy_odc and args.greedy_peer:
        try:
            a = json.loads(Path(args.greedy_odc).read_text())["greedy"]
            b = json.loads(Path(args.greedy_peer).read_text())["greedy"]
            same = sum(x == y for x, y in zip(a, b))
            first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                     for x, y in zip(a, b) if x != y]
            verdict = "PASS" if same == len(a) == len(b) and a else "FAIL"
            lines.append(f"greedy f32, odc vs transformers: {same}/{len(a)} responses equal "
                         f"token for token {verdict}"
                         + (f" (first differences at tokens {first[:8]})" if first else ""))
        except (OSError, ValueError, KeyError, TypeError) as e:
            lines.append(f"greedy f32, odc vs transformers: not compared ({e})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="a random-weight HF model directory in a public shape")
    m.add_argument("--shape", required=True, choices=sorted(SHAPES))
    m.add_argument("--data", help="GSM8K JSONL the tokenizer is trained on")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    m.add_argument("--tokenizer-vocab", type=int, default=0,
                   help="most ids of the BPE (default 16384, 512 for the tiny shapes; at most "
                        "the model's vocabulary)")
    m.add_argument("--tokenizer-from", help="copy tokenizer.json from this model directory")
    t = sub.add_parser("train", help="time SFT steps in PyTorch eager + transformers")
    t.add_argument("--model-dir", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--batch-size", type=int, required=True, help="problems per step")
    t.add_argument("--steps", type=int, required=True, help="timed steps (after --warmup)")
    t.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    t.add_argument("--json")
    t.add_argument("--count-steps", type=int, default=0,
                   help="also count the tokens of this many steps' samples (for odc's log)")
    t.add_argument("--device", help="cuda (default when available) or cpu")
    t.add_argument("--amp", choices=["bf16", "off"], default="bf16")
    t.add_argument("--attn-mask", choices=["causal", "padding"], default="causal")
    t.add_argument("--micro-batch-tokens", type=int, default=16_384,
                   help="most padded tokens in one micro-batch")
    t.add_argument("--token-budget", type=int, default=4096,
                   help="odc's --token-budget: longer samples are skipped, as odc skips them")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--lr-warmup-steps", type=int, default=20)
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad-norm", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's dense bf16 peak (default: 989 for H100/H200)")
    o = sub.add_parser("odc-log", help="read an odc sft log")
    o.add_argument("log")
    o.add_argument("--warmup", type=int, default=1)
    o.add_argument("--peer-json")
    r = sub.add_parser("report", help="figures.sh's table")
    r.add_argument("--runs", required=True)
    r.add_argument("--gpu-name", default="")
    r.add_argument("--out")
    g = sub.add_parser("generate", help="time transformers' batched generate on odc's prompts")
    g.add_argument("--model-dir", required=True)
    g.add_argument("--prompts", required=True, help="odc-bench generate --prompts-out's JSON")
    g.add_argument("--json", required=True)
    g.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    g.add_argument("--device", help="cuda (default when available) or cpu")
    g.add_argument("--decode-batch", type=int, default=0, help="prompts per generate (0: all)")
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    gr = sub.add_parser("generate-report", help="sampling.sh's rows")
    gr.add_argument("--odc", required=True, help="odc-bench generate JSONs, comma-separated")
    gr.add_argument("--peer", required=True, help="peer.py generate JSONs, comma-separated")
    gr.add_argument("--greedy-odc")
    gr.add_argument("--greedy-peer")
    gr.add_argument("--out")
    args = p.parse_args()
    if args.cmd == "generate":
        generate(args)
    elif args.cmd == "generate-report":
        generate_report(args)
    elif args.cmd == "make-model":
        if not args.data and not args.tokenizer_from:
            die("make-model needs --data (or --tokenizer-from)")
        make_model(args)
    elif args.cmd == "train":
        train(args)
    elif args.cmd == "odc-log":
        print(json.dumps(odc_log(args.log, args.warmup, args.peer_json)))
    else:
        sys.exit(report(args))


if __name__ == "__main__":
    main()
