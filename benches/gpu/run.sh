#!/usr/bin/env bash
# Runs the binaries benches/gpu/build.sh made, on a machine with an NVIDIA GPU, its driver and
# /usr/local/cuda (libnvrtc, libcublas, libcurand, libcudart) — no cargo, no network — and prints a
# table, one line per check: PASS or FAIL with its figures. Logs (and the calibration profile,
# profile.json) go to $OUT (if set) or to <folder>/logs; each FAIL row names its log.
#
#   benches/gpu/run.sh [FOLDER]         (default target/gpu-bin)
#
# Exit status: 0 when every check passed. A check that was skipped (a test printing "skipped",
# e.g. because no driver was found) counts as FAIL here: on this machine everything must run.
# The binaries are stored compressed (bin.tar.xz) and unpacked into a temporary folder first.
# QUICK=1 runs only the checks of part 2 (candle on CUDA), for a second run after a fix;
# MEASURE=0 runs only the correctness checks (no transport bench, SFT, calibration, sft-overhead).
# The correctness checks (the tests) run side by side first, each with at most CHECK_CAP seconds
# (default 240); the measurements (transport bench, SFT, sft-overhead, calibrate) then run one at
# a time, alone on the GPU. DEADLINE=S: every check ends within S seconds of the start (each is
# cut at what is left, and a check cut or never started is a FAIL row saying so), so that a short
# lease still brings a table back.
set -uo pipefail
cd "$(dirname "$0")/../.."
FOLDER="${1:-target/gpu-bin}"
LOGS="${OUT:-$FOLDER/logs}"
mkdir -p "$LOGS"
LOGS="$(cd "$LOGS" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RUST_BACKTRACE=1
run_started=$SECONDS

if [ ! -f "$FOLDER/MANIFEST" ]; then
  echo "run.sh: no $FOLDER/MANIFEST: run benches/gpu/build.sh first (on the build machine)" >&2
  exit 2
fi
# The binaries, unpacked into a temporary folder (benches/gpu/unpack.sh).
BIN="$(mktemp -d "${TMPDIR:-/tmp}/odc-gpu-bin.XXXXXX")"
trap 'rm -rf "$BIN"' EXIT
benches/gpu/unpack.sh "$FOLDER" "$BIN" || exit 2
export ODC_CONFORMANCE_OWNER="$BIN/odc-conformance-owner"
# Where the GPU runs' candle kernels are JIT-compiled once per machine.
export CUDA_CACHE_MAXSIZE=4294967296
DESIGNED_SKIP='refused_write_changes_nothing_c8 skipped: a write guard for a region owned by another process'

cp "$FOLDER/MANIFEST" "$LOGS/MANIFEST"
{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } >"$LOGS/nvidia-smi.txt"

# Rows go to a file, keyed by section and order, so that checks run in the background add theirs.
ROWS="$LOGS/rows.tsv"
: >"$ROWS"
section=0
row_n=0
row() { # CHECK RESULT FIGURES
  row_n=$((row_n + 1))
  printf '%03d.%03d\t%s\t%s\t%s\n' "$section" "$row_n" "$1" "$2" "$3" >>"$ROWS"
}
next_section() {
  section=$((section + 1))
  row_n=0
}

DEADLINE="${DEADLINE:-0}"
CHECK_CAP="${CHECK_CAP:-240}"
# capped CAP COMMAND...: COMMAND with at most CAP seconds, fewer when the deadline is nearer; exit
# 124 when cut, or when too little time is left to start it.
capped() {
  local cap="$1"
  shift
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - (SECONDS - run_started) - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 5 ]; then
      echo "run.sh: not started: the deadline (DEADLINE=$DEADLINE s) has passed"
      return 124
    fi
  fi
  timeout -k 10 "$cap" "$@"
}
# cut_note RC: says so when RC is timeout's.
cut_note() { if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "cut at its time limit; "; fi; }

# check NAME LOG -- COMMAND...: run COMMAND (stdout and stderr to $LOGS/LOG), one row: PASS if it
# exited 0 and skipped nothing, with the test harness's counts as figures.
check() {
  local name="$1" log="$LOGS/$2"
  shift 3
  local started=$SECONDS
  capped "$CHECK_CAP" "$@" >"$log" 2>&1
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
    row "$name" FAIL "$(cut_note $rc)exit $rc; $figures; $(grep -m1 -E 'panicked|error' "$log")"
  fi
}

echo "run.sh: $(head -3 "$FOLDER/MANIFEST" | tail -2 | tr '\n' ' ')"
echo "run.sh: GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
echo "run.sh: logs in $LOGS"

has() { [ -x "$BIN/$1" ]; }
# A row for a binary build.sh did not make (part 2 skipped with SKIP_CANDLE=1).
missing() { row "$1" FAIL "not built: $2 is not in $FOLDER (build.sh with part 2)"; }

# --- Phase 1: the correctness checks, side by side ------------------------------------------------

# gpu_test TEST NAME LOG: one test of gpu_training, PASS/FAIL with the line it printed.
gpu_test() {
  local test="$1" name="$2" log="$LOGS/$3"
  local started=$SECONDS
  capped "$CHECK_CAP" "$BIN/gpu_training" "$test" --exact --nocapture --test-threads=1 >"$log" 2>&1
  local rc=$? secs=$((SECONDS - started))
  local said
  # The test's line (after libtest's `test NAME ... ` when the output interleaves).
  said=$(grep -o -E '(I3 GPU|bf16 on the GPU|SFT on CUDA|ring attention on CUDA|device transfers|collective vs on demand|device path resumed|fused kernels on|fused kernels in bf16|sampler.s weights|a gang on the GPU)[^"]*' "$log" | head -2 | tr '\n' ' ' | cut -c1-400)
  if grep -q '^skipped' "$log"; then
    row "$name" FAIL "skipped: $(grep -m1 '^skipped' "$log"); log $log"
  elif [ "$rc" -eq 0 ] && grep -q 'test result: ok. 1 passed' "$log"; then
    row "$name" PASS "${said:-passed}; ${secs} s"
  else
    row "$name" FAIL "$(cut_note $rc)exit $rc; ${said:-no figures}; $(grep -m1 -E 'panicked|error' "$log"); log $log"
  fi
}

if [ "${QUICK:-0}" != 1 ]; then
  next_section
  check "cuda unit tests (NVRTC kernels, exact adds)" unit.log -- \
    "$BIN/odc_transport_lib" cuda:: --nocapture --test-threads=1 &
  next_section
  check "conformance, owner and reader in one process" conformance.log -- \
    "$BIN/cuda_conformance" --nocapture --test-threads=4 &
  next_section
  check "conformance, owner in another process (IPC)" process-conformance.log -- \
    "$BIN/cuda_process_conformance" --nocapture --test-threads=4 &
  next_section
  check "shard servers on the GPU vs the host store" servers.log -- \
    "$BIN/odc_actors_lib" server::device --nocapture --test-threads=1 &
  next_section
  check "I3: a job with GPU servers vs host servers" gpu-servers.log -- \
    "$BIN/gpu_servers" --nocapture &
  next_section
  if has odc_kernels_device; then
    check "fused kernels vs CPU references (NVRTC, fresh inputs)" kernels.log -- \
      "$BIN/odc_kernels_device" --nocapture --test-threads=1 &
  else
    missing "fused kernels vs CPU references" odc_kernels_device
  fi
fi # QUICK
next_section
if has gpu_training; then
  gpu_test gpu_fp32_training_equals_the_cpu_reference "I3: GPU fp32 vs CPU (losses, parameters)" i3-gpu.log &
  next_section
  gpu_test gpu_bf16_losses_track_the_cpu_fp32_run "mixed precision: GPU bf16 vs CPU fp32" bf16-gpu.log &
  next_section
  gpu_test sft_on_cuda_lowers_the_loss "SFT on CUDA in bf16, 12 steps (test)" sft-test.log &
  next_section
  gpu_test device_transfers_equal_host_transfers_and_stage_nothing \
    "device-resident path vs host path (fp32; 0 bytes staged)" resident-gpu.log &
  next_section
  gpu_test a_trainer_killed_after_its_device_pushes_replays_to_the_same_result \
    "device path: a trainer killed after its pushes (I2 replay)" replay-gpu.log &
  next_section
  gpu_test collective_equals_on_demand_on_the_device \
    "device path: on demand = collective (0 bytes staged)" collective-gpu.log &
  next_section
  gpu_test a_device_job_resumes_from_its_checkpoint_exactly \
    "device path: resume from a checkpoint" resume-gpu.log &
  next_section
  gpu_test the_samplers_weights_come_device_to_device \
    "RL sampler's weights device to device (0 bytes staged)" sampler-weights-gpu.log &
  next_section
  gpu_test a_gangs_kv_moves_device_to_device \
    "a gang's K/V device to device (split = whole; 0 bytes staged)" gang-kv-gpu.log &
  next_section
  gpu_test fused_kernels_train_as_the_cpu_reference \
    "fused kernels (ODC_FUSED_KERNELS=1): GPU vs CPU (I3)" fused-gpu.log &
  next_section
  gpu_test ring_attention_on_cuda_equals_the_blocked_attention \
    "sequence splitting: ring attention on CUDA" ring-gpu.log &
  next_section
  # The same with the fused kernels: each pair of chunks one launch of the varlen kernels (the
  # whole sample stays candle's blocked attention).
  ODC_FUSED_KERNELS=1 gpu_test ring_attention_on_cuda_equals_the_blocked_attention \
    "sequence splitting with the fused kernels (ring attention)" ring-fused-gpu.log &
else
  missing "I3: GPU fp32 vs CPU" gpu_training
fi
wait
echo "run.sh: the correctness checks ended after $((SECONDS - run_started)) s"

# --- Phase 2: the measurements, one at a time, alone on the GPU ---------------------------------
# MEASURE=0 stops here (the correctness rows only, e.g. before benches/gpu/figures.sh).
if [ "${MEASURE:-1}" = 0 ]; then
  echo "run.sh: MEASURE=0: the measurements are not run"
else

# The transport benchmark: one row per measured row (its ratio to the device's own limit), then one
# per target (met = PASS).
if [ "${QUICK:-0}" != 1 ]; then
  next_section
  bench_log="$LOGS/bench-transport-cuda.log"
  capped 60 "$BIN/odc-bench" transport --backends cuda --rounds 6 --measure-ms 60 \
    --json "$LOGS/bench-transport-cuda.json" >"$bench_log" 2>&1
  bench_rc=$?
  if [ "$bench_rc" -ne 0 ]; then
    row "odc-bench transport --backends cuda" FAIL "$(cut_note $bench_rc)exit $bench_rc: $(grep -m1 error "$bench_log")"
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
fi # QUICK

# SFT of gpu-100m on CUDA: 2 processes sharing the GPU under `odc launch --transport cuda`.
sft_log="$LOGS/sft-cuda-launch.log"
next_section
if has sft && has odc; then
  started=$SECONDS
  capped 120 "$BIN/odc" launch --nprocs 2 --transport cuda --timeout-secs 300 -- "$BIN/sft" --device cuda \
    --model gpu-100m --steps 30 --batch-size 64 --token-budget 16384 --warmup-steps 5 \
    --eval-every 0 --eval-problems 4 --max-new-tokens 48 --no-metrics >"$sft_log" 2>&1
  rc=$?
  secs=$((SECONDS - started))
  first=$(grep -E '^step +1/' "$sft_log" | sed -E 's/.*loss ([0-9.eE+-]+|NaN|inf).*/\1/' | head -1)
  last=$(grep -E '^final step=' "$sft_log" | sed -E 's/.* loss=([^ ]+).*/\1/' | tail -1)
  rate=$(grep -E ' steps in .* tokens/s' "$sft_log" | sed -E 's/.*: ([0-9.]+) tokens\/s.*/\1/' | tail -1)
  # MFU of the run (arithmetic samples of ~150 tokens: attention is negligible), 6 x the
  # 99.3 M parameters that multiply (without the embedding table) per token, H100 SXM 989 TFLOP/s.
  mfu=$(awk -v r="${rate:-0}" 'BEGIN { printf "%.4f", 6 * 99308544 * r / 989e12 }')
  figures="loss ${first:-?} -> ${last:-?}, ${rate:-?} tokens/s (MFU ~$mfu), eval: $(grep -m1 -E '^eval step' "$sft_log" | cut -c1-60); ${secs} s; log $sft_log"
  if [ "$rc" -eq 0 ] && awk -v a="${first:-nan}" -v b="${last:-nan}" \
    'BEGIN { exit !(a == a + 0 && b == b + 0 && b < 0.8 * a) }'; then
    row "SFT gpu-100m on CUDA, odc launch 2 procs, 30 steps" PASS "$figures"
  else
    row "SFT gpu-100m on CUDA, odc launch 2 procs, 30 steps" FAIL \
      "$(cut_note $rc)exit $rc; $figures; $(grep -m1 -iE 'error|panicked' "$sft_log")"
  fi
else
  missing "SFT gpu-100m on CUDA" "sft or odc"
fi

# Calibration: per-unit forward + backward against tokens, the profile for the simulator.
cal_log="$LOGS/calibrate-cuda.log"
next_section
if has odc-bench-gpu; then
  capped 150 "$BIN/odc-bench-gpu" calibrate --device cuda --models gpu-100m,block-1.5b,block-7b \
    --tokens 256,512,1024,2048,4096,8192,16384 --warmup 1 --reps 3 \
    --json "$LOGS/profile.json" >"$cal_log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    row "calibrate --device cuda" FAIL "$(cut_note $rc)exit $rc: $(grep -m1 -iE 'error|panicked' "$cal_log"); log $cal_log"
  else
    while IFS= read -r line; do
      name=$(echo "$line" | sed -E 's/^result calibrate model=([^ ]+) unit=([^ ]+).*/calibrate \1 \2/')
      figures=${line#*unit=* }
      if echo "$line" | grep -q ' a = '; then
        row "$name" PASS "$figures"
      else
        row "$name" FAIL "$figures; log $cal_log"
      fi
    done < <(grep '^result calibrate' "$cal_log")
    row "calibration profile" "$([ -s "$LOGS/profile.json" ] && echo PASS || echo FAIL)" "$LOGS/profile.json"
  fi
else
  missing "calibrate --device cuda" odc-bench-gpu
fi
# odc vs candle alone on the GPU (2 trainers of one process sharing it), ABBA, with MFU.
so_log="$LOGS/sft-overhead-cuda.log"
next_section
if has odc-bench-gpu; then
  capped 120 "$BIN/odc-bench-gpu" sft-overhead --device cuda --model gpu-100m --steps 2 --rounds 2 \
    --batch-size 48 --token-budget 4096 --min-len 128 --max-len 1024 >"$so_log" 2>&1
  rc=$?
  result=$(grep -m1 '^result sft-overhead' "$so_log")
  if [ "$rc" -ne 0 ] || [ -z "$result" ]; then
    row "sft-overhead --device cuda" FAIL "$(cut_note $rc)exit $rc: $(grep -m1 -iE 'error|panicked' "$so_log"); log $so_log"
  else
    field() { echo "$result" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
    row "sft-overhead cuda: candle alone (bf16)" PASS \
      "$(field candle_tokens_per_s) tokens/s, MFU $(field candle_mfu) of $(field peak_tflops) TFLOP/s"
    row "sft-overhead cuda: odc, 2 trainers on 1 GPU" PASS \
      "$(field odc_tokens_per_s) tokens/s, MFU $(field odc_mfu)"
    control=$(field control)
    row "sft-overhead cuda: control (candle vs candle)" \
      "$(awk -v c="$control" 'BEGIN { print (c >= 0.95 && c <= 1.05) ? "PASS" : "FAIL" }')" \
      "$control (must read 1.00 within 5%)"
    row "target sft-overhead cuda odc/candle <= $(field target)" \
      "$([ "$(field verdict)" = met ] && echo PASS || echo FAIL)" "ratio $(field ratio); log $so_log"
  fi
else
  missing "sft-overhead --device cuda" odc-bench-gpu
fi

fi # MEASURE
echo "run.sh: $((SECONDS - run_started)) s in all"

echo
printf '%-46s %-5s %s\n' check result figures
printf '%s\n' "$(printf '%.0s-' {1..100})"
sort -t "$(printf '\t')" -k1,1 "$ROWS" | while IFS="$(printf '\t')" read -r _ name result figures; do
  printf '%-46s %-5s %s\n' "$name" "$result" "$figures"
done
echo
failed=0
[ -s "$ROWS" ] || failed=1
if awk -F '\t' '$3 != "PASS" { bad = 1 } END { exit !bad }' "$ROWS"; then failed=1; fi
if [ "$failed" -eq 0 ]; then echo "run.sh: every check passed"; else echo "run.sh: some checks FAILED (logs in $LOGS)"; fi
exit "$failed"
