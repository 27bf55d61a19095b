#!/usr/bin/env bash
# Issue 40's figures on one GPU, in one run, as one table: odc against the PyTorch peer a GPU user
# runs instead (PyTorch eager + transformers, AMP bf16, SDPA, fused AdamW: benches/gpu/peer.py) on
# the same model directory and the same GSM8K chat samples; odc against candle alone
# (`sft-overhead`); the parameter and gradient bytes that crossed host memory per step.
#
#   DEADLINE=480 benches/gpu/figures.sh [BIN_FOLDER]      (default target/gpu-bin, from build.sh)
#
# Needs on the GPU machine: the binaries build.sh packs (sft, odc, odc-bench-gpu; bin.tar.xz,
# NAME.xz or plain), python3 with torch, transformers, tokenizers and safetensors (no network), and the
# GSM8K training set at $DATA (default target/gpu-data/train.jsonl).
#
# What runs, in this order (each command capped with `timeout` at what is left of DEADLINE
# seconds; a row whose command was cut or never started says so):
#   1. peer.py make-model: random weights in the SmolLM2-135M shape and a BPE tokenizer trained on
#      $DATA (bf16 safetensors);
#   2. SmolLM2-135M shape at $SMOL_BATCH (64) problems a step, ABBA: peer, odc, odc, peer;
#      odc = `sft --device cuda --model-dir DIR --data $DATA --batch-size N --steps W+S
#      --eval-every 0 --no-metrics` (one process, odc's defaults otherwise);
#   3. `odc-bench-gpu sft-overhead --device cuda --model-dir DIR` (short ABBA with its control);
#   4. the Qwen2.5-0.5B shape (same tokenizer) at $QWEN_BATCH (32), ABBA as in 2;
#   5. `odc launch --nprocs 2 --transport cuda -- sft ...` on the SmolLM2 shape at $LAUNCH_BATCH
#      (32), then the peer at the same batch.
# odc's rate leaves out its first $ODC_WARMUP step(s), the peer's its first $PEER_WARMUP.
#
# Knobs (environment): DEADLINE (480; 0 = none), DATA, PYTHON (python3), ODC_STEPS (3 timed),
# ODC_WARMUP (1), PEER_STEPS (10 timed), PEER_WARMUP (3), SMOL_BATCH (64), QWEN_BATCH (32),
# LAUNCH_BATCH (32), SO_STEPS (5), SO_ROUNDS (3), SO_BATCH (16), SO_MIN_LEN (128), SO_MAX_LEN
# (512), ODC_ARGS / PEER_ARGS / SO_ARGS (extra flags), SKIP ("qwen launch sft-overhead host
# f32 fused", any of them; host: the SmolLM2 run with --host-transfers after its ABBA; fused: each
# shape's run with ODC_FUSED_KERNELS=1 after its ABBA; f32: its first
# loss in fp32 against the peer's without autocast), MODELS (where the model directories go: ${TMPDIR:-/tmp}/odc-figures/models),
# SMOL_SHAPE / QWEN_SHAPE (peer.py's shapes; `tiny` and `tiny-qwen` for a test without a GPU).
#
# Output: the table on stdout and in $OUT/figures.txt (target/gpu-figures when OUT is unset); the
# logs, the peer's JSON results and runs.tsv in $OUT/figures-logs.tar.gz (and, without OUT, in
# target/gpu-figures/logs). Exit status 0 when every row was measured and every control and
# check read within its bounds; a missed target (odc / candle, host bytes) does not count.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT="$(pwd)"
FOLDER="${1:-target/gpu-bin}"
DEST="${OUT:-target/gpu-figures}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
SCRATCH="${TMPDIR:-/tmp}/odc-figures"
if [ -n "${OUT:-}" ]; then LOGDIR="$SCRATCH/logs"; else LOGDIR="$DEST/logs"; fi
MODELS="${MODELS:-$SCRATCH/models}"
rm -rf "$LOGDIR"
mkdir -p "$LOGDIR" "$MODELS"
LOGDIR="$(cd "$LOGDIR" && pwd)"
MODELS="$(cd "$MODELS" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUDA_CACHE_MAXSIZE=4294967296
run_started=$SECONDS

DEADLINE="${DEADLINE:-480}"
DATA="${DATA:-target/gpu-data/train.jsonl}"
PYTHON="${PYTHON:-python3}"
PEER="$ROOT/benches/gpu/peer.py"
ODC_STEPS="${ODC_STEPS:-3}"
ODC_WARMUP="${ODC_WARMUP:-1}"
PEER_STEPS="${PEER_STEPS:-10}"
PEER_WARMUP="${PEER_WARMUP:-3}"
# The fused run's steps: the peer's warm-up and timed steps, so the two loss curves share their
# steps and their learning-rate schedule (issue 41 compares them).
CURVE_STEPS="${CURVE_STEPS:-$((PEER_WARMUP + PEER_STEPS))}"
SMOL_BATCH="${SMOL_BATCH:-64}"
QWEN_BATCH="${QWEN_BATCH:-32}"
LAUNCH_BATCH="${LAUNCH_BATCH:-32}"
SO_STEPS="${SO_STEPS:-5}"
SO_ROUNDS="${SO_ROUNDS:-3}"
SO_BATCH="${SO_BATCH:-16}"
SO_MIN_LEN="${SO_MIN_LEN:-128}"
SO_MAX_LEN="${SO_MAX_LEN:-512}"
SKIP="${SKIP:-}"
read -r -a odc_args <<<"${ODC_ARGS:-}"
read -r -a peer_args <<<"${PEER_ARGS:-}"
read -r -a so_args <<<"${SO_ARGS:-}"
SMOL="${SMOL_SHAPE:-smollm2-135m}"
QWEN="${QWEN_SHAPE:-qwen2.5-0.5b}"

# The binaries, unpacked as run.sh does (benches/gpu/unpack.sh).
BIN="$(mktemp -d "${TMPDIR:-/tmp}/odc-figures-bin.XXXXXX")"
trap 'rm -rf "$BIN"' EXIT
PYTHON="$PYTHON" benches/gpu/unpack.sh "$FOLDER" "$BIN" || echo "figures.sh: cannot unpack $FOLDER" >&2
has() { [ -x "$BIN/$1" ]; }

gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
[ -n "$gpu" ] || gpu="$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>/dev/null)"
{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } >"$LOGDIR/nvidia-smi.txt"
[ -f "$FOLDER/MANIFEST" ] && cp "$FOLDER/MANIFEST" "$LOGDIR/MANIFEST"
echo "figures.sh: GPU ${gpu:-?}; binaries from $FOLDER ($(ls "$BIN" | tr '\n' ' ')); deadline ${DEADLINE} s; logs in $LOGDIR"

# One line per run: key, kind, shape, batch, warm-up steps, exit status (empty: never started),
# seconds, log, JSON result, note.
RUNS="$LOGDIR/runs.tsv"
: >"$RUNS"
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RUNS"; }

# capped CAP COMMAND...: COMMAND with at most CAP seconds, fewer when the deadline is nearer
# (run.sh's rule); 124 when cut, 200 when too little time is left to start it.
capped() {
  local cap="$1"
  shift
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - (SECONDS - run_started) - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
      echo "figures.sh: not started: the deadline (DEADLINE=$DEADLINE s) has passed"
      return 200
    fi
  fi
  timeout -k 10 "$cap" "$@"
}

# run KEY KIND SHAPE BATCH WARMUP CAP JSON -- COMMAND...: COMMAND's output to $LOGDIR/KEY.log and
# one line in runs.tsv.
run() {
  local key="$1" kind="$2" shape="$3" batch="$4" warmup="$5" cap="$6" json="$7"
  shift 8
  local log="$LOGDIR/$key.log" started=$SECONDS
  echo "figures.sh: [$((SECONDS - run_started)) s] $key"
  capped "$cap" "$@" >"$log" 2>&1
  local rc=$?
  if [ "$rc" -eq 200 ]; then
    record "$key" "$kind" "$shape" "$batch" "$warmup" "" "0" "$log" "$json" \
      "not started: the deadline (DEADLINE=$DEADLINE s) had passed"
  else
    record "$key" "$kind" "$shape" "$batch" "$warmup" "$rc" "$((SECONDS - started))" "$log" "$json" ""
  fi
  return "$rc"
}
# not_run KEY KIND SHAPE BATCH WHY: a row that could not run.
not_run() { record "$1" "$2" "$3" "$4" "0" "" "0" "" "" "$5"; }

skipped() { case " $SKIP " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# make SHAPE [TOKENIZER_FROM]
make_model() {
  local shape="$1" from="${2:-}"
  local tok=(--data "$DATA")
  [ -n "$from" ] && [ -f "$from/tokenizer.json" ] && tok=(--tokenizer-from "$from")
  rm -rf "${MODELS:?}/$shape"
  run "make.$shape" make "$shape" - 0 120 "" -- \
    "$PYTHON" "$PEER" make-model --shape "$shape" "${tok[@]}" --out "$MODELS/$shape"
}

peer_run() { # KEY KIND SHAPE BATCH
  local key="$1" kind="$2" shape="$3" batch="$4"
  run "$key" "$kind" "$shape" "$batch" "$PEER_WARMUP" 150 "$LOGDIR/$key.json" -- \
    "$PYTHON" "$PEER" train --model-dir "$MODELS/$shape" --data "$DATA" --batch-size "$batch" \
    --steps "$PEER_STEPS" --warmup "$PEER_WARMUP" \
    --count-steps $((ODC_WARMUP + ODC_STEPS > CURVE_STEPS ? ODC_WARMUP + ODC_STEPS : CURVE_STEPS)) \
    --json "$LOGDIR/$key.json" "${peer_args[@]}"
}

odc_run() { # KEY SHAPE BATCH CAP [KIND [FLAGS...]]: odc's sft (KIND odc-host: --host-transfers;
  # odc-fused: with ODC_FUSED_KERNELS=1)
  local key="$1" shape="$2" batch="$3" cap="$4" kind="${5:-odc}"
  shift 5 2>/dev/null || shift $#
  local envs=(env) steps=$((ODC_WARMUP + ODC_STEPS))
  [ "$kind" = odc-fused ] && envs=(env ODC_FUSED_KERNELS=1) && steps="$CURVE_STEPS"
  if ! has sft; then
    not_run "$key" "$kind" "$shape" "$batch" "not built: sft is not in $FOLDER (build.sh with part 2)"
    return
  fi
  run "$key" "$kind" "$shape" "$batch" "$ODC_WARMUP" "$cap" "" -- \
    "${envs[@]}" "$BIN/sft" --device cuda --model-dir "$MODELS/$shape" --data "$DATA" --batch-size "$batch" \
    --steps "$steps" --eval-every 0 --no-metrics --step-stats \
    --trace "$LOGDIR/$key.trace.json" "$@" "${odc_args[@]}"
}

# ABBA: peer, odc, odc, peer.
abba() { # SHAPE BATCH ODC_CAP
  local shape="$1" batch="$2" cap="$3"
  local tag="$shape.x$batch"
  if [ ! -f "$MODELS/$shape/model.safetensors" ]; then
    for k in A1 B1 B2 A2; do
      case $k in A*) kind=peer ;; *) kind=odc ;; esac
      not_run "$tag.$k" "$kind" "$shape" "$batch" "no model directory (make-model failed)"
    done
    return
  fi
  peer_run "$tag.A1" peer "$shape" "$batch"
  odc_run "$tag.B1" "$shape" "$batch" "$cap"
  odc_run "$tag.B2" "$shape" "$batch" "$cap"
  peer_run "$tag.A2" peer "$shape" "$batch"
}

[ -f "$DATA" ] ||
  echo "figures.sh: no training data at $DATA (copy ../shared/data/gsm8k/train.jsonl there)" >&2
{
  # 1–2. SmolLM2-135M shape.
  make_model "$SMOL"
  abba "$SMOL" "$SMOL_BATCH" 150
  # The first loss in fp32 against transformers' (no autocast) on the same step: within 1e-4.
  if ! skipped f32 && [ -f "$MODELS/$SMOL/model.safetensors" ]; then
    run "$SMOL.f32.A" peer-f32 "$SMOL" "$SMOL_BATCH" 0 90 "$LOGDIR/$SMOL.f32.A.json" -- \
      "$PYTHON" "$PEER" train --model-dir "$MODELS/$SMOL" --data "$DATA" \
      --batch-size "$SMOL_BATCH" --steps 1 --warmup 0 --amp off --json "$LOGDIR/$SMOL.f32.A.json" \
      "${peer_args[@]}"
    if has sft; then
      run "$SMOL.f32.B" odc-f32 "$SMOL" "$SMOL_BATCH" 0 90 "" -- \
        "$BIN/sft" --device cuda --model-dir "$MODELS/$SMOL" --data "$DATA" \
        --batch-size "$SMOL_BATCH" --steps 1 --precision f32 --eval-every 0 --no-metrics \
        --step-stats "${odc_args[@]}"
    fi
  fi
  # Issue 41's fused kernels (ODC_FUSED_KERNELS=1: norms, rotary, SwiGLU, the head's loss and
  # FlashAttention-2 on tensor cores in bf16) on the same samples, after the ABBA.
  if ! skipped fused && [ -f "$MODELS/$SMOL/model.safetensors" ]; then
    odc_run "$SMOL.x$SMOL_BATCH.F" "$SMOL" "$SMOL_BATCH" 150 odc-fused
  fi
  # The path before the device-resident one, on the same samples: servers and transfers in host
  # memory (the A/B of this issue's change).
  if ! skipped host && [ -f "$MODELS/$SMOL/model.safetensors" ]; then
    odc_run "$SMOL.x$SMOL_BATCH.H" "$SMOL" "$SMOL_BATCH" 150 odc-host --host-transfers
  fi

  # 3. odc against candle alone.
  if skipped sft-overhead; then
    :
  elif ! has odc-bench-gpu; then
    not_run sft-overhead sft-overhead "$SMOL" "$SO_BATCH" "not built: odc-bench-gpu is not in $FOLDER"
  elif [ ! -f "$MODELS/$SMOL/model.safetensors" ]; then
    not_run sft-overhead sft-overhead "$SMOL" "$SO_BATCH" "no model directory (make-model failed)"
  else
    run sft-overhead sft-overhead "$SMOL" "$SO_BATCH" 0 150 "" -- \
      "$BIN/odc-bench-gpu" sft-overhead --device cuda --model-dir "$MODELS/$SMOL" \
      --steps "$SO_STEPS" --rounds "$SO_ROUNDS" --batch-size "$SO_BATCH" --token-budget 4096 \
      --min-len "$SO_MIN_LEN" --max-len "$SO_MAX_LEN" "${so_args[@]}"
  fi

  # 4. Qwen2.5-0.5B shape, the same tokenizer.
  if ! skipped qwen; then
    make_model "$QWEN" "$MODELS/$SMOL"
    abba "$QWEN" "$QWEN_BATCH" 200
    if ! skipped fused && [ -f "$MODELS/$QWEN/model.safetensors" ]; then
      odc_run "$QWEN.x$QWEN_BATCH.F" "$QWEN" "$QWEN_BATCH" 200 odc-fused
    fi
  fi

  # 5. Two processes on the GPU under odc launch, and the peer at the same batch.
  if ! skipped launch; then
    tag="$SMOL.x$LAUNCH_BATCH.launch"
    if ! has sft || ! has odc; then
      not_run "$tag.B" launch "$SMOL" "$LAUNCH_BATCH" "not built: sft or odc is not in $FOLDER"
    elif [ ! -f "$MODELS/$SMOL/model.safetensors" ]; then
      not_run "$tag.B" launch "$SMOL" "$LAUNCH_BATCH" "no model directory (make-model failed)"
    else
      run "$tag.B" launch "$SMOL" "$LAUNCH_BATCH" "$ODC_WARMUP" 150 "" -- \
        "$BIN/odc" launch --nprocs 2 --transport cuda --timeout-secs 300 -- \
        "$BIN/sft" --device cuda --model-dir "$MODELS/$SMOL" --data "$DATA" \
        --batch-size "$LAUNCH_BATCH" --steps $((ODC_WARMUP + ODC_STEPS)) --eval-every 0 \
        --no-metrics --step-stats "${odc_args[@]}"
      peer_run "$tag.A" peer-launch "$SMOL" "$LAUNCH_BATCH"
    fi
  fi
}

echo "figures.sh: $((SECONDS - run_started)) s in all"
echo
"$PYTHON" "$PEER" report --runs "$RUNS" --gpu-name "${gpu:-}" --out "$DEST/figures.txt"
status=$?
if [ "$status" -gt 1 ] || [ ! -s "$DEST/figures.txt" ]; then
  echo "figures.sh: the report failed (exit $status); the runs:" >&2
  cat "$RUNS" >&2
  status=1
fi
tar -czf "$DEST/figures-logs.tar.gz" -C "$(dirname "$LOGDIR")" "$(basename "$LOGDIR")" 2>/dev/null ||
  echo "figures.sh: could not pack the logs" >&2
echo
echo "figures.sh: table in $DEST/figures.txt, logs in $DEST/figures-logs.tar.gz"
exit "$status"
