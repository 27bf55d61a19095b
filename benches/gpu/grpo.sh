#!/usr/bin/env bash
# Issue 42's GRPO row: one `rl_grpo` run on the GPU and the same run on this machine's CPU, each
# step's wall time split into verl's stages (gen, reward, ref, the wait for other ranks' groups,
# the odc update), as a table: the mean over the steps after the first (the first compiles
# kernels and warms caches), and the GPU's speedup per stage.
#
#   DEADLINE=240 benches/gpu/grpo.sh [MODEL_DIR|-] [BIN_FOLDER]     (default -, target/gpu-bin)
#
# `-` (the default) is rl_grpo's own model after its SFT warm start (SFT_STEPS, 150): a policy
# whose groups score differently, so every stage runs (a random model directory's groups all
# score 0: nothing to train, no ref or update stage). sampling.sh runs it last. Knobs: DEADLINE
# (240 s for both runs; 0 = none), GPU_DEVICE (cuda), PRECISION (bf16 on the GPU; the CPU runs
# fp32), STEPS (3), CPU_STEPS (2), PROMPTS (32), GROUP (8), MAX_NEW (rl_grpo's default), LOGDIR
# (a scratch folder). The binary is rl_grpo from the folder (unpack.sh), built by build.sh with
# the root crate's `cuda` feature; a folder without it prints "not run".
set -uo pipefail
MODEL_DIR="${1:--}"
FOLDER="${2:-target/gpu-bin}"
DEADLINE="${DEADLINE:-240}"
GPU_DEVICE="${GPU_DEVICE:-cuda}"
PRECISION="${PRECISION:-bf16}"
STEPS="${STEPS:-3}"
CPU_STEPS="${CPU_STEPS:-2}"
PROMPTS="${PROMPTS:-32}"
GROUP="${GROUP:-8}"
MAX_NEW="${MAX_NEW:-}"
SFT_STEPS="${SFT_STEPS:-150}"
model=(--sft-steps "$SFT_STEPS")
[ "$MODEL_DIR" = - ] || model=(--model-dir "$MODEL_DIR")
[ -z "$MAX_NEW" ] || model+=(--max-new-tokens "$MAX_NEW")
LOGDIR="${LOGDIR:-$(mktemp -d "${TMPDIR:-/tmp}/odc-grpo.XXXXXX")}"
mkdir -p "$LOGDIR"
started=$SECONDS

"$(dirname "$0")/unpack.sh" "$FOLDER" "$LOGDIR/bin" >&2
bin="$LOGDIR/bin/rl_grpo"
if [ ! -s "$bin" ]; then
  echo "GRPO stages: not run (no rl_grpo in $FOLDER: benches/gpu/build.sh)"
  exit 0
fi

# run KEY DEVICE STEPS CAP [FLAGS...]: the run's output in $LOGDIR/grpo.KEY.log.
run() {
  local key="$1" device="$2" steps="$3" cap="$4"
  shift 4
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - (SECONDS - started) - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
      echo "not started: the deadline (DEADLINE=$DEADLINE s) had passed" >"$LOGDIR/grpo.$key.log"
      return 200
    fi
  fi
  timeout -k 10 "$cap" "$bin" "${model[@]}" --device "$device" --steps "$steps" \
    --prompts "$PROMPTS" --group-size "$GROUP" --eval-problems 0 --no-metrics "$@" \
    >"$LOGDIR/grpo.$key.log" 2>&1
}
whole=$DEADLINE
[ "$whole" -gt 0 ] || whole=3600
run gpu "$GPU_DEVICE" "$STEPS" $((whole / 2)) --precision "$PRECISION"
# The CPU run takes what the GPU run left.
run cpu cpu "$CPU_STEPS" "$whole"

# Per log: the mean of each stage over the steps after the first, from lines like
# "step   2/3 ... sampling 1.2 s (gen 0.9, reward 0.0, ref 0.1, gather 0.0)  loss +0.1 update 0.4 s"
# (a step that trained nothing says "no update": its update counts 0).
python3 - "$LOGDIR/grpo.gpu.log" "$LOGDIR/grpo.cpu.log" <<'EOF'
import re, sys

def stages(path):
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None, "no log"
    steps = []
    for line in lines:
        m = re.search(r"^step\s+(\d+)/\d+.*?sampling ([\d.]+) s \(gen ([\d.]+), reward ([\d.]+), "
                      r"ref ([\d.]+), gather ([\d.]+)\)(.*)$", line)
        if not m:
            continue
        update = re.search(r"update ([\d.]+) s", m.group(7))
        steps.append([float(m.group(i)) for i in range(3, 7)] +
                     [float(update.group(1)) if update else 0.0])
    if not steps:
        tail = " | ".join(lines[-3:]) if lines else "empty"
        return None, f"no step lines ({tail})"
    later = steps[1:] or steps
    return [sum(s[i] for s in later) / len(later) for i in range(5)], f"{len(steps)} steps"

names = ["gen", "reward", "ref", "gather", "update"]
gpu, gpu_note = stages(sys.argv[1])
cpu, cpu_note = stages(sys.argv[2])
print(f"GRPO stages, seconds per step (mean after the first): GPU {gpu_note}, CPU {cpu_note}")
print("| stage | GPU | CPU | CPU / GPU |")
print("|---|---|---|---|")
for i, name in enumerate(names):
    g = f"{gpu[i]:.2f}" if gpu else "not run"
    c = f"{cpu[i]:.2f}" if cpu else "not run"
    r = f"{cpu[i] / gpu[i]:.1f}x" if gpu and cpu and gpu[i] > 0 else "-"
    print(f"| {name} | {g} | {c} | {r} |")
EOF
