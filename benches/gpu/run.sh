#!/usr/bin/env bash
# Runs the binaries benches/gpu/build.sh made, on a machine with an NVIDIA GPU, its driver and
# /usr/local/cuda (for libnvrtc) — no cargo, no network — and prints a table, one line per check:
# PASS or FAIL with its figures. Logs go to $OUT (if set) or to <folder>/logs.
#
#   benches/gpu/run.sh [FOLDER]         (default target/gpu-bin)
#
# Exit status: 0 when every check passed. A check that was skipped (a test printing "skipped",
# e.g. because no driver was found) counts as FAIL here: on this machine everything must run.
# Later parts add checks with more `check` lines (see the bottom).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${1:-target/gpu-bin}"
LOGS="${OUT:-$BIN/logs}"
mkdir -p "$LOGS"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ODC_CONFORMANCE_OWNER="$BIN/odc-conformance-owner"
export RUST_BACKTRACE=1
DESIGNED_SKIP='refused_write_changes_nothing_c8 skipped: a write guard for a region owned by another process'

if [ ! -f "$BIN/MANIFEST" ]; then
  echo "run.sh: no $BIN/MANIFEST: run benches/gpu/build.sh first (on the build machine)" >&2
  exit 2
fi
cp "$BIN/MANIFEST" "$LOGS/MANIFEST"
{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } >"$LOGS/nvidia-smi.txt"

rows=()
failed=0
row() { # CHECK RESULT FIGURES
  rows+=("$(printf '%-46s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = PASS ] || failed=1
}

# check NAME LOG -- COMMAND...: run COMMAND (stdout and stderr to $LOGS/LOG), one row: PASS if it
# exited 0 and skipped nothing, with the test harness's counts as figures.
check() {
  local name="$1" log="$LOGS/$2"
  shift 3
  local started=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  local secs=$((SECONDS - started))
  local counts skipped
  counts=$(grep -E '^test result:' "$log" | tail -1 | sed -E 's/^test result: [A-Za-z]+\. //; s/; finished in.*//')
  # C8's write guard is a closure in the owner's process: with the owner in a child process the
  # suite skips it by design (as for tcp and shm); any other skip counts.
  skipped=$(grep 'skipped' "$log" | grep -vc "$DESIGNED_SKIP")
  local figures="${counts:-no test summary}; ${secs} s; log $log"
  if [ "$rc" -eq 0 ] && [ "$skipped" -eq 0 ]; then
    row "$name" PASS "$figures"
  elif [ "$rc" -eq 0 ]; then
    row "$name" FAIL "$skipped test(s) skipped: $(grep -m1 'skipped' "$log")"
  else
    row "$name" FAIL "exit $rc; $figures; $(grep -m1 -E 'panicked|error' "$log")"
  fi
}

echo "run.sh: $(head -3 "$BIN/MANIFEST" | tail -2 | tr '\n' ' ')"
echo "run.sh: GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
echo "run.sh: logs in $LOGS"

check "cuda unit tests (NVRTC kernels, exact adds)" unit.log -- \
  "$BIN/odc_transport_lib" cuda:: --nocapture --test-threads=1
check "conformance, owner and reader in one process" conformance.log -- \
  "$BIN/cuda_conformance" --nocapture --test-threads=4
check "conformance, owner in another process (IPC)" process-conformance.log -- \
  "$BIN/cuda_process_conformance" --nocapture --test-threads=4
check "shard servers on the GPU vs the host store" servers.log -- \
  "$BIN/odc_actors_lib" server::device --nocapture --test-threads=1
check "I3: a job with GPU servers vs host servers" gpu-servers.log -- \
  "$BIN/gpu_servers" --nocapture

# The benchmark: one row per measured row (its ratio to the device's own limit), then one per
# target (met = PASS).
bench_log="$LOGS/bench-transport-cuda.log"
"$BIN/odc-bench" transport --backends cuda --rounds 6 --measure-ms 60 \
  --json "$LOGS/bench-transport-cuda.json" >"$bench_log" 2>&1
bench_rc=$?
if [ "$bench_rc" -ne 0 ]; then
  row "odc-bench transport --backends cuda" FAIL "exit $bench_rc: $(grep -m1 error "$bench_log")"
else
  while read -r backend size unit gbs limit ratio _; do
    row "bench $backend $size $unit" PASS "$gbs GB/s, limit $limit GB/s, ratio $ratio"
  done < <(grep -E '^cuda-[a-z0-9-]+ +[0-9]' "$bench_log")
  while IFS= read -r line; do
    name=${line%%:*}
    verdict=${line##*: }
    figures=${line#*: }
    figures=${figures%: *}
    row "$name" "$([ "$verdict" = met ] && echo PASS || echo FAIL)" "$figures"
  done < <(grep -E '^target cuda' "$bench_log")
fi

echo
printf '%-46s %-5s %s\n' check result figures
printf '%s\n' "$(printf '%.0s-' {1..100})"
printf '%s\n' "${rows[@]}"
echo
if [ "$failed" -eq 0 ]; then echo "run.sh: every check passed"; else echo "run.sh: some checks FAILED (logs in $LOGS)"; fi
exit "$failed"
