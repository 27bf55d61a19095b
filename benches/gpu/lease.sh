#!/usr/bin/env bash
# One call on a lent GPU machine: benches/gpu/run.sh's correctness rows (MEASURE=0), then
# benches/gpu/figures.sh (odc against the PyTorch peer and candle alone, host bytes per step),
# then benches/gpu/python.sh (the Python package's wheel on the GPU: its GPU path's checks and
# odc + PyTorch against PyTorch alone), then benches/gpu/sampling.sh (odc's batched sampler
# against transformers' generate, greedy parity), each within its share of DEADLINE seconds, with
# at most 8 files back under $OUT (the device tool's limit): run.txt (run.sh's table),
# run-logs.tar.gz, figures.txt (the figures' table), figures-run.txt (figures.sh's own output),
# figures-logs.tar.gz, python.tar.gz (python.sh's table.tsv and logs), sampling.txt and
# sampling-logs.tar.gz (sampling-run.err only where sampling.sh printed errors).
#
#   OUT=... DEADLINE=540 CHECKS=150 benches/gpu/lease.sh [BIN_FOLDER]   (default target/gpu-bin)
#
# The GSM8K training set is read from target/gpu-data/train.jsonl (or its .xz, unpacked here):
# copy ../shared/data/gsm8k/train.jsonl there before the call and carry target/gpu-data.
# SKIP_CHECKS=1 leaves run.sh out, SKIP_FIGURES=1 figures.sh, SKIP_PYTHON=1 python.sh,
# SKIP_SAMPLING=1 sampling.sh; FIGURES_ENV and SAMPLING_ENV pass more variables to them (e.g.
# "SKIP=qwen", "SHAPES=smollm2-135m"); PYTHON_SHARE (200) and SAMPLING_SHARE (120) are the seconds
# kept for python.sh and sampling.sh when they run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
FOLDER="${1:-target/gpu-bin}"
OUT="${OUT:-target/gpu-lease}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
DEADLINE="${DEADLINE:-540}"
CHECKS="${CHECKS:-150}"
started=$SECONDS
scratch="$(mktemp -d "${TMPDIR:-/tmp}/odc-lease.XXXXXX")"

data=target/gpu-data/train.jsonl
if [ ! -f "$data" ] && [ -f "$data.xz" ]; then
  xz -dkc "$data.xz" >"$data" 2>/dev/null ||
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$data.xz" "$data"
fi

if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  OUT="$scratch/run" MEASURE=0 DEADLINE="$CHECKS" CHECK_CAP=$((CHECKS - 10)) \
    benches/gpu/run.sh "$FOLDER" >"$OUT/run.txt" 2>&1
  echo "lease.sh: run.sh exit $? after $((SECONDS - started)) s" >>"$OUT/run.txt"
  tar -czf "$OUT/run-logs.tar.gz" -C "$scratch" run 2>/dev/null
fi

keep=0
[ "${SKIP_SAMPLING:-0}" != 1 ] && keep="${SAMPLING_SHARE:-120}"
python_share=0
[ "${SKIP_PYTHON:-0}" != 1 ] && python_share="${PYTHON_SHARE:-200}"
keep=$((keep + python_share))
left=$((DEADLINE - (SECONDS - started) - 15 - keep))
if [ "${SKIP_FIGURES:-0}" = 1 ]; then
  :
elif [ "$left" -lt 60 ]; then
  echo "lease.sh: $left s left: figures.sh not run" | tee "$OUT/figures-run.txt"
else
  # shellcheck disable=SC2086
  env ${FIGURES_ENV:-} OUT="$OUT" DEADLINE="$left" benches/gpu/figures.sh "$FOLDER" \
    >"$OUT/figures-run.txt" 2>&1
  echo "lease.sh: figures.sh exit $? after $((SECONDS - started)) s" >>"$OUT/figures-run.txt"
fi
left=$((DEADLINE - (SECONDS - started) - 15 - ${SAMPLING_SHARE:-120} * (${SKIP_SAMPLING:-0} != 1)))
if [ "${SKIP_PYTHON:-0}" = 1 ]; then
  :
elif [ "$left" -lt 60 ]; then
  echo "lease.sh: $left s left: python.sh not run" | tee -a "$OUT/figures-run.txt"
else
  OUT="$scratch/python" DEADLINE="$left" benches/gpu/python.sh "$FOLDER" \
    >"$scratch/python-run.txt" 2>&1
  echo "lease.sh: python.sh exit $? after $((SECONDS - started)) s" >>"$scratch/python-run.txt"
  mv "$scratch/python-run.txt" "$scratch/python/" 2>/dev/null
  tar -czf "$OUT/python.tar.gz" -C "$scratch" python 2>/dev/null
fi
left=$((DEADLINE - (SECONDS - started) - 15))
if [ "${SKIP_SAMPLING:-0}" = 1 ]; then
  :
elif [ "$left" -lt 60 ]; then
  echo "lease.sh: $left s left: sampling.sh not run" | tee "$OUT/sampling.txt"
else
  # shellcheck disable=SC2086
  env ${SAMPLING_ENV:-} OUT="$OUT" DEADLINE="$left" benches/gpu/sampling.sh "$FOLDER" \
    >/dev/null 2>"$OUT/sampling-run.err"
  [ -s "$OUT/sampling-run.err" ] || rm -f "$OUT/sampling-run.err"
fi
rm -rf "$scratch"
grep -E 'PASS|FAIL|every check|some checks' "$OUT/run.txt" 2>/dev/null | tail -40
cat "$OUT/figures.txt" 2>/dev/null || tail -30 "$OUT/figures-run.txt" 2>/dev/null
tar -xzOf "$OUT/python.tar.gz" python/table.tsv 2>/dev/null
cat "$OUT/sampling.txt" 2>/dev/null
