#!/usr/bin/env bash
# The Python package's GPU rows, on the GPU machine (python3 with torch and transformers; no Rust,
# no network), under one DEADLINE (seconds, default 540), writing table.tsv and logs under $OUT
# (or FOLDER/logs):
#   1. the wheel benches/gpu/build.sh bundled (FOLDER/wheels/odc-*.whl) installs with pip, no
#      index, no dependencies, beside the machine's torch, and imports;
#   2. benches/python/gpu_checks.py: the GPU path's correctness rows (zero copy, device vs host,
#      bf16, 0 host bytes, odc.torch.shard on the device vs PyTorch alone, 2 ranks by torchrun);
#   3. benches/python/torch_vs_fsdp2.py --gpu: odc + PyTorch vs PyTorch alone on the
#      SmolLM2-135M shape under bf16 autocast, ABBA with its control, first losses, host bytes.
#
#   benches/gpu/python.sh [FOLDER]      (default target/gpu-bin)
set -uo pipefail
cd "$(dirname "$0")/../.."
FOLDER="${1:-target/gpu-bin}"
LOGS="${OUT:-$FOLDER/logs}"
mkdir -p "$LOGS"
DEADLINE="${DEADLINE:-540}"
started=$SECONDS
TABLE="$LOGS/table.tsv"
: >"$TABLE"
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" | tee -a "$TABLE"; }
left() { echo $((DEADLINE - (SECONDS - started) - 5)); }

site="$(mktemp -d "${TMPDIR:-/tmp}/odc-python.XXXXXX")"
trap 'rm -rf "$site"' EXIT
wheel="$(ls "$FOLDER"/wheels/odc-*.whl 2>/dev/null | head -1)"
if [ -z "$wheel" ]; then
  row FAIL "the wheel installs" "no $FOLDER/wheels/odc-*.whl: run benches/gpu/build.sh"
  exit 1
fi
if python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel" >"$LOGS/pip.log" 2>&1 \
  && PYTHONPATH="$site" python3 -c 'import odc, torch' >>"$LOGS/pip.log" 2>&1; then
  row PASS "the wheel installs" "$(basename "$wheel") into $(python3 -V 2>&1), torch $(python3 -c 'import torch; print(torch.__version__)')"
else
  row FAIL "the wheel installs" "see pip.log: $(tail -1 "$LOGS/pip.log")"
  exit 1
fi
export PYTHONPATH="$site"

timeout -k 10 "$(left)" python3 benches/python/gpu_checks.py >"$LOGS/gpu_checks.log" 2>&1
rc=$?
awk -F '\t' '$1 == "PASS" || $1 == "FAIL"' "$LOGS/gpu_checks.log" | tee -a "$TABLE"
[ "$rc" -ne 0 ] && row FAIL "gpu_checks.py" "exit $rc (124: cut at the deadline); see gpu_checks.log"

timeout -k 10 "$(left)" python3 benches/python/torch_vs_fsdp2.py --gpu --steps 12 --warmup 2 \
  >"$LOGS/overhead.log" 2>&1
rc=$?
if [ "$rc" -eq 0 ]; then
  # The row's figures: s/step of each side, odc's over PyTorch's (target <= 1.05), the control.
  row RAN "odc + PyTorch vs PyTorch alone, SmolLM2-135M shape, bf16" \
    "$(grep -E '^overhead' "$LOGS/overhead.log" | tr -s ' ') | $(grep -E 'first loss|host bytes' "$LOGS/overhead.log" | tr -s ' ' | paste -sd '|')"
else
  row FAIL "odc + PyTorch vs PyTorch alone" "exit $rc; see overhead.log: $(tail -1 "$LOGS/overhead.log")"
fi
nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1 || true
echo "python.sh: $((SECONDS - started)) s"
! grep -q '^FAIL' "$TABLE"
