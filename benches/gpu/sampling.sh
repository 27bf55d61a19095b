#!/usr/bin/env bash
# Issue 42's figures, in one run, as one table: odc's batched sampler (`odc-bench generate`: KV
# cache, prompts left-padded together, one decode for all of them) against the peer a user runs
# instead, `transformers`' batched `generate` (benches/gpu/peer.py generate), on the same model
# directory, the same prompt token ids (GSM8K questions in the directory's chat template) and the
# same maximum new tokens; and odc's greedy responses against transformers' in fp32.
#
#   DEADLINE=240 benches/gpu/sampling.sh [BIN_FOLDER]     (default target/gpu-bin, from build.sh)
#
# Per shape of SHAPES: peer.py make-model when MODELS has no such directory (figures.sh's, when
# it ran first); the prompts; ABBA: peer, odc, odc, peer (`--rounds 2` each; each side's best
# round counts); then the parity row: GREEDY_PROMPTS prompts, one greedy response of GREEDY_NEW
# tokens each, odc and the peer both in fp32. With FUSED=1 (the default), last and only if the
# deadline leaves time: odc again with ODC_FUSED_KERNELS=1 (decoding's fused attention over the
# KV cache), one sampled run and the greedy row, reported against the same peer runs. Then, with
# GRPO=1 (the default) and what the deadline leaves, benches/gpu/grpo.sh: a GRPO step's stages
# (gen, reward, ref, gather, update) on the GPU against the same run on the CPU.
#
# Knobs: DEADLINE (240; 0 = none), DATA (target/gpu-data/train.jsonl), PYTHON, SHAPES
# ("smollm2-135m qwen2.5-0.5b"; "tiny" for a CPU smoke test with DEVICE=cpu), DEVICE (cuda),
# PROMPTS (64), SAMPLES (8), MAX_NEW (256), GREEDY_PROMPTS (8), GREEDY_NEW (64), FUSED (1), PEER_DTYPE (bf16),
# ODC_PRECISION (PEER_DTYPE's),
# MODELS (${TMPDIR:-/tmp}/odc-figures/models). The odc side is odc-bench-gpu from the folder
# (odc-bench on the CPU, when DEVICE=cpu).
# Output: the table on stdout and in $OUT/sampling.txt (target/gpu-sampling when OUT is unset),
# the logs and JSONs in $OUT/sampling-logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
FOLDER="${1:-target/gpu-bin}"
DEST="${OUT:-target/gpu-sampling}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/odc-sampling.XXXXXX")"
LOGDIR="$SCRATCH/sampling"
mkdir -p "$LOGDIR"
trap 'rm -rf "$SCRATCH"' EXIT
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
started=$SECONDS

DEADLINE="${DEADLINE:-240}"
DATA="${DATA:-target/gpu-data/train.jsonl}"
PYTHON="${PYTHON:-python3}"
PEER="benches/gpu/peer.py"
SHAPES="${SHAPES:-smollm2-135m qwen2.5-0.5b}"
DEVICE="${DEVICE:-cuda}"
PROMPTS="${PROMPTS:-64}"
SAMPLES="${SAMPLES:-8}"
MAX_NEW="${MAX_NEW:-256}"
GREEDY_PROMPTS="${GREEDY_PROMPTS:-8}"
GREEDY_NEW="${GREEDY_NEW:-64}"
FUSED="${FUSED:-1}"
PEER_DTYPE="${PEER_DTYPE:-bf16}"
# odc's sampled rows in the peer's precision (f32 or bf16); the greedy parity rows stay fp32.
ODC_PRECISION="${ODC_PRECISION:-$PEER_DTYPE}"
MODELS="${MODELS:-${TMPDIR:-/tmp}/odc-figures/models}"
mkdir -p "$MODELS"

# The odc side: odc-bench-gpu (NAME.xz or plain) on a GPU; odc-bench on the CPU.
name=odc-bench-gpu
[ "$DEVICE" = cpu ] && name=odc-bench
PYTHON="$PYTHON" benches/gpu/unpack.sh "$FOLDER" "$SCRATCH/bin" >&2
ODC="$SCRATCH/bin/$name"

# capped CAP COMMAND... > LOG: at most CAP seconds, fewer as the deadline nears (figures.sh's rule).
capped() {
  local cap="$1"
  shift
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - (SECONDS - started) - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
      echo "not started: the deadline (DEADLINE=$DEADLINE s) had passed"
      return 200
    fi
  fi
  timeout -k 10 "$cap" "$@"
}
step() { # KEY CAP COMMAND...: the command's output in $LOGDIR/KEY.log
  local key="$1" cap="$2"
  shift 2
  echo "sampling.sh: [$((SECONDS - started)) s] $key"
  capped "$cap" "$@" >"$LOGDIR/$key.log" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && echo "sampling.sh: $key exited $rc (log: $key.log)"
  return "$rc"
}

: >"$DEST/sampling.txt"
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
echo "sampling.sh: ${gpu:-no GPU}; device $DEVICE; $PROMPTS prompts x $SAMPLES samples, $MAX_NEW new tokens" |
  tee -a "$DEST/sampling.txt"
if [ ! -x "$ODC" ]; then
  echo "not run: $name is not in $FOLDER (benches/gpu/build.sh)" | tee -a "$DEST/sampling.txt"
fi
for shape in $SHAPES; do
  [ -x "$ODC" ] || break
  dir="$MODELS/$shape"
  if [ ! -f "$dir/model.safetensors" ]; then
    step "make.$shape" 120 "$PYTHON" "$PEER" make-model --shape "$shape" --data "$DATA" --out "$dir"
  fi
  gen=("$ODC" generate --model-dir "$dir" --data "$DATA" --device "$DEVICE")
  sampled=(--prompts "$PROMPTS" --samples "$SAMPLES" --max-new-tokens "$MAX_NEW")
  greedy=(--prompts "$GREEDY_PROMPTS" --samples 1 --max-new-tokens "$GREEDY_NEW" --temperature 0)
  step "$shape.prompts" 60 "${gen[@]}" "${sampled[@]}" --rounds 0 \
    --prompts-out "$LOGDIR/$shape.prompts.json"
  step "$shape.greedy-prompts" 60 "${gen[@]}" "${greedy[@]}" --rounds 0 \
    --prompts-out "$LOGDIR/$shape.greedy-prompts.json"
  peer=("$PYTHON" "$PEER" generate --model-dir "$dir" --prompts "$LOGDIR/$shape.prompts.json")
  step "$shape.A1" 150 "${peer[@]}" --dtype "$PEER_DTYPE" --json "$LOGDIR/$shape.A1.json"
  step "$shape.B1" 150 "${gen[@]}" "${sampled[@]}" --precision "$ODC_PRECISION" \
    --json "$LOGDIR/$shape.B1.json"
  step "$shape.B2" 150 "${gen[@]}" "${sampled[@]}" --precision "$ODC_PRECISION" \
    --json "$LOGDIR/$shape.B2.json"
  step "$shape.A2" 150 "${peer[@]}" --dtype "$PEER_DTYPE" --json "$LOGDIR/$shape.A2.json"
  step "$shape.greedy.odc" 90 "${gen[@]}" "${greedy[@]}" --rounds 1 \
    --json "$LOGDIR/$shape.greedy.odc.json"
  step "$shape.greedy.peer" 90 "$PYTHON" "$PEER" generate --model-dir "$dir" \
    --prompts "$LOGDIR/$shape.greedy-prompts.json" --dtype f32 --rounds 1 \
    --json "$LOGDIR/$shape.greedy.peer.json"
  echo "== $shape (sampled: peer in $PEER_DTYPE, odc in $ODC_PRECISION; greedy: both fp32)" \
    >>"$DEST/sampling.txt"
  "$PYTHON" "$PEER" generate-report --odc "$LOGDIR/$shape.B1.json,$LOGDIR/$shape.B2.json" \
    --peer "$LOGDIR/$shape.A1.json,$LOGDIR/$shape.A2.json" \
    --greedy-odc "$LOGDIR/$shape.greedy.odc.json" --greedy-peer "$LOGDIR/$shape.greedy.peer.json" \
    >>"$DEST/sampling.txt" 2>&1
done
if [ "$FUSED" = 1 ]; then
  for shape in $SHAPES; do
    [ -x "$ODC" ] && [ -f "$LOGDIR/$shape.A1.json" ] || continue
    gen=("$ODC" generate --model-dir "$MODELS/$shape" --data "$DATA" --device "$DEVICE")
    sampled=(--prompts "$PROMPTS" --samples "$SAMPLES" --max-new-tokens "$MAX_NEW")
    greedy=(--prompts "$GREEDY_PROMPTS" --samples 1 --max-new-tokens "$GREEDY_NEW" --temperature 0)
    step "$shape.F1" 150 env ODC_FUSED_KERNELS=1 "${gen[@]}" "${sampled[@]}" \
      --precision "$ODC_PRECISION" --json "$LOGDIR/$shape.F1.json" || continue
    step "$shape.greedy.fused" 90 env ODC_FUSED_KERNELS=1 "${gen[@]}" "${greedy[@]}" --rounds 1 \
      --json "$LOGDIR/$shape.greedy.fused.json"
    echo "== $shape, odc with ODC_FUSED_KERNELS=1 (decoding's fused attention)" >>"$DEST/sampling.txt"
    "$PYTHON" "$PEER" generate-report --odc "$LOGDIR/$shape.F1.json" \
      --peer "$LOGDIR/$shape.A1.json,$LOGDIR/$shape.A2.json" \
      --greedy-odc "$LOGDIR/$shape.greedy.fused.json" \
      --greedy-peer "$LOGDIR/$shape.greedy.peer.json" >>"$DEST/sampling.txt" 2>&1
  done
fi
# Last, with what the deadline leaves: a GRPO step's stages on the GPU and on the CPU (grpo.sh).
if [ "${GRPO:-1}" = 1 ]; then
  left=0
  [ "$DEADLINE" -gt 0 ] && left=$((DEADLINE - (SECONDS - started) - 10))
  if [ "$DEADLINE" -gt 0 ] && [ "$left" -lt 60 ]; then
    echo "GRPO stages: not run ($left s left of DEADLINE=$DEADLINE)" >>"$DEST/sampling.txt"
  else
    echo "sampling.sh: [$((SECONDS - started)) s] grpo"
    DEADLINE="$left" LOGDIR="$LOGDIR" GPU_DEVICE="$DEVICE" PRECISION="$ODC_PRECISION" \
      bash benches/gpu/grpo.sh - "$FOLDER" >>"$DEST/sampling.txt" 2>&1
  fi
fi
echo "sampling.sh: $((SECONDS - started)) s in all" | tee -a "$DEST/sampling.txt"
tar -czf "$DEST/sampling-logs.tar.gz" -C "$SCRATCH" sampling 2>/dev/null
cat "$DEST/sampling.txt"
