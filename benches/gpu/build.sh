#!/usr/bin/env bash
# Builds every GPU test and benchmark binary of odc here (no GPU needed) into ONE folder that
# `benches/gpu/run.sh` runs on a GPU machine without cargo. Binaries are stripped and stored in
# one solid archive, `bin.tar.xz` (candle's CUDA kernels make each candle binary 37-79 MB, most of
# it the same bytes, which a solid archive with a large dictionary stores once: on 2026-11-29
# the five candle binaries took 17 MB together, against 46 MB compressed one by one at the same
# `xz -6`); `benches/gpu/unpack.sh` unpacks it for run.sh and the other scripts.
#
#   benches/gpu/build.sh [OUT_DIR]        (default target/gpu-bin; PROFILE=dev for a debug build)
#
# Part 1, no CUDA install needed (cudarc loads libcuda and libnvrtc at run time):
#   odc_transport_lib          the odc-transport unit tests with --features cuda,conformance
#                              (run.sh runs `cuda::`: kernels compiled by NVRTC, exact adds, copies)
#   cuda_conformance           the conformance suite, owner and reader in one process
#   cuda_process_conformance   the conformance suite, owner in a child process (CUDA IPC)
#   odc-conformance-owner      that child (run.sh points ODC_CONFORMANCE_OWNER at it)
#   odc_kernels_device         odc-kernels' device tests: the fused kernels vs their CPU references
#   odc-bench                  `odc-bench transport --backends cuda`
#   odc_actors_lib             the odc-actors unit tests with --features cuda (run.sh runs
#                              `server::device`: the GPU store against the host store)
#   gpu_servers                a whole job with shard servers on the GPU against the host (I3)
# Part 2, candle on CUDA (the root crate's `cuda` feature; candle's kernels need nvcc at build
# time, ~11 minutes on 2 cores the first time, and link stubs for the CUDA libraries):
#   gpu_training               tests/gpu_training.rs: I3 GPU vs CPU (fp32), bf16 vs fp32, SFT on CUDA
#   sft                        examples/sft (--device cuda, --model gpu-100m)
#   rl_grpo                    examples/rl_grpo (--device cuda; benches/gpu/grpo.sh)
#   odc                        `odc launch` (run.sh: --transport cuda, 2 processes on one GPU)
#   odc-bench-gpu              odc-bench with feature `gpu`: sft-overhead --device cuda, calibrate
# Part 3, the Python package: wheels/odc-*.whl (maturin; benches/gpu/python.sh runs its GPU rows).
# The toolchain for part 2: CUDA_ROOT (etc.) already exported, or the folder
# ODC_CUDA_TOOLKIT (default $CARGO_TARGET_DIR/cuda-toolkit) made by
# ../shared/gpu/make-cuda-toolkit.sh, which this script runs when the folder is missing (it
# downloads NVIDIA's wheels from PyPI). SKIP_CANDLE=1 builds part 1 only.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-target/gpu-bin}"
PROFILE="${PROFILE:-release}"
export CARGO_TERM_COLOR=never
started=$(date +%s)

case "$PROFILE" in
  release) profile_flag=(--release); profile_dir=release ;;
  dev) profile_flag=(); profile_dir=debug ;;
  *) echo "build.sh: PROFILE must be release or dev, not $PROFILE" >&2; exit 2 ;;
esac
target_dir="${CARGO_TARGET_DIR:-target}"

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
manifest="$OUT_DIR/MANIFEST"
{
  echo "# odc GPU binaries, built by benches/gpu/build.sh; run with benches/gpu/run.sh"
  echo "# commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version 2>/dev/null | head -1), $(rustc --version), profile $PROFILE"
  echo "# name	kind	what"
} >"$manifest"

command -v xz >/dev/null 2>&1 || { echo "build.sh: xz is needed (apt-get install xz-utils)" >&2; exit 1; }
stage="$OUT_DIR/.stage"
mkdir -p "$stage"
add() { # NAME KIND WHAT PATH: stripped into the stage, packed at the end
  local name="$1" kind="$2" what="$3" path="$4"
  if [ ! -x "$path" ]; then
    echo "build.sh: $name: no executable at $path" >&2
    exit 1
  fi
  strip -o "$stage/$name" "$path" 2>/dev/null || cp "$path" "$stage/$name"
  printf '%s\t%s\t%s\n' "$name" "$kind" "$what" >>"$manifest"
}

# The executables a `cargo test --no-run --message-format=json` built, one "target-name path" a line.
test_executables() {
  grep -o '"target":{[^}]*"name":"[^"]*"[^}]*}.*"executable":"[^"]*"' \
    | sed -E 's/.*"target":\{[^}]*"name":"([^"]*)".*"executable":"([^"]*)".*/\1 \2/'
}

echo "build.sh: odc-transport tests with --features cuda,conformance ($PROFILE)"
tests=$(cargo test "${profile_flag[@]}" -p odc-transport --features cuda,conformance \
  --lib --test cuda_conformance --test cuda_process_conformance --no-run --message-format=json \
  | test_executables)
lookup() { echo "$tests" | awk -v n="$1" '$1 == n { print $2 }' | tail -1; }
add odc_transport_lib test "odc-transport unit tests (run with the filter cuda::)" "$(lookup odc_transport)"
add cuda_conformance test "conformance suite, owner and reader in one process" "$(lookup cuda_conformance)"
add cuda_process_conformance test "conformance suite, owner in a child process (CUDA IPC)" \
  "$(lookup cuda_process_conformance)"

echo "build.sh: odc-kernels device tests with --features nvrtc ($PROFILE)"
tests=$(cargo test "${profile_flag[@]}" -p odc-kernels --features nvrtc,odc-transport/conformance \
  --test device --no-run --message-format=json | test_executables)
add odc_kernels_device test "the fused kernels against their CPU references (kernels/tests/device.rs)" \
  "$(lookup device)"

echo "build.sh: odc-conformance-owner and odc-bench with the cuda feature ($PROFILE)"
cargo build "${profile_flag[@]}" -p odc-transport --features cuda,conformance --bin odc-conformance-owner
add odc-conformance-owner bin "owner process of cuda_process_conformance (ODC_CONFORMANCE_OWNER)" \
  "$target_dir/$profile_dir/odc-conformance-owner"
cargo build "${profile_flag[@]}" -p odc-bench --features cuda --bin odc-bench
add odc-bench bin "odc-bench transport --backends cuda" "$target_dir/$profile_dir/odc-bench"

echo "build.sh: odc-actors tests with --features cuda ($PROFILE)"
tests=$(cargo test "${profile_flag[@]}" -p odc-actors --features cuda --lib --test gpu_servers \
  --no-run --message-format=json | test_executables)
add odc_actors_lib test "odc-actors unit tests (run with the filter server::device)" "$(lookup odc_actors)"
add gpu_servers test "a job with shard servers on the GPU equals the host job (I3)" "$(lookup gpu_servers)"

if [ "${SKIP_CANDLE:-0}" = 1 ]; then
  echo "build.sh: SKIP_CANDLE=1: part 2 (candle on CUDA) not built" >&2
else
  # Part 2: the CUDA toolchain candle's `cuda` feature needs at build time.
  if [ -z "${CUDA_ROOT:-}" ]; then
    toolkit="${ODC_CUDA_TOOLKIT:-$target_dir/cuda-toolkit}"
    if [ ! -x "$toolkit/site/nvidia/cu13/bin/nvcc" ] || [ ! -f "$toolkit/stub/libcuda.so" ]; then
      maker="$(cd .. && pwd)/shared/gpu/make-cuda-toolkit.sh"
      if [ ! -f "$maker" ]; then
        echo "build.sh: no CUDA toolchain: export CUDA_ROOT etc., or set ODC_CUDA_TOOLKIT to a \
folder made by make-cuda-toolkit.sh (not found at $maker); SKIP_CANDLE=1 builds part 1 only" >&2
        exit 1
      fi
      echo "build.sh: making the CUDA toolchain in $toolkit ($maker)"
      bash "$maker" "$toolkit" >/dev/null
    fi
    toolkit="$(cd "$toolkit" && pwd)"
    export CUDA_ROOT="$toolkit/site/nvidia/cu13" CUDA_PATH="$toolkit/site/nvidia/cu13"
    export PATH="$toolkit/site/nvidia/cu13/bin:$PATH" LIBRARY_PATH="$toolkit/stub"
  fi
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  echo "build.sh: candle on CUDA (odc --features cuda; CUDA_ROOT=$CUDA_ROOT, compute capability $CUDA_COMPUTE_CAP)"
  gpu_tests=$(cargo test "${profile_flag[@]}" -p odc --features cuda,cli --test gpu_training \
    --no-run --message-format=json | test_executables)
  add gpu_training test "I3 GPU vs CPU (fp32), bf16 vs fp32, SFT on CUDA (tests/gpu_training.rs)" \
    "$(echo "$gpu_tests" | awk '$1 == "gpu_training" { print $2 }' | tail -1)"
  cargo build "${profile_flag[@]}" -p odc -p odc-bench --features odc/cuda,odc/cli,odc-bench/gpu \
    --example sft --example rl_grpo --bin odc --bin odc-bench
  add sft example "examples/sft with --device cuda" "$target_dir/$profile_dir/examples/sft"
  add rl_grpo example "examples/rl_grpo with --device cuda (benches/gpu/grpo.sh)" \
    "$target_dir/$profile_dir/examples/rl_grpo"
  add odc bin "odc launch (--transport cuda)" "$target_dir/$profile_dir/odc"
  add odc-bench-gpu bin "odc-bench with feature gpu: sft-overhead --device cuda, calibrate" \
    "$target_dir/$profile_dir/odc-bench"
fi

# Part 3: the Python package's wheel (abi3: any CPython >= 3.9, the GPU machine's 3.12 with its
# torch 2.11), its GPU path included; benches/gpu/python.sh installs and runs it. maturin comes
# from the tools environment tests/python.rs makes (or PyPI).
maturin="$target_dir/python/tools/bin/maturin"
if [ ! -x "$maturin" ]; then
  python3 -m venv "$target_dir/python/tools" && "$target_dir/python/tools/bin/pip" install -q \
    "maturin>=1.9.4,<2"
fi
mkdir -p "$OUT_DIR/wheels"
"$maturin" build "${profile_flag[@]}" --manifest-path python/Cargo.toml --out "$OUT_DIR/wheels"
echo "wheels/$(basename "$(ls "$OUT_DIR"/wheels/odc-*.whl | head -1)")	wheel	the odc Python package (benches/gpu/python.sh)" >>"$manifest"

# One solid archive, one thread (a block per thread would split what the binaries share), a
# dictionary larger than any binary: 256 MiB to unpack.
echo "build.sh: packing $(du -sh "$stage" | cut -f1) into $OUT_DIR/bin.tar.xz"
tar -C "$stage" -cf - . | xz -T1 -6 --lzma2=dict=256MiB >"$OUT_DIR/bin.tar.xz"
rm -rf "$stage"
echo "build.sh: $(($(date +%s) - started)) s; $OUT_DIR:"
cat "$manifest"
du -sh "$OUT_DIR"
size_kib=$(du -sk "$OUT_DIR" | cut -f1)
if [ "$size_kib" -gt $((60 * 1024)) ]; then
  echo "build.sh: $OUT_DIR is $((size_kib / 1024)) MiB: over the 60 MiB that may travel to the GPU machine" >&2
  exit 1
fi
