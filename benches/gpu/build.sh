#!/usr/bin/env bash
# Builds every GPU test and benchmark binary of odc here (no GPU, no CUDA install needed: cudarc
# loads libcuda and libnvrtc at run time) into ONE folder that `benches/gpu/run.sh` runs on a GPU
# machine without cargo.
#
#   benches/gpu/build.sh [OUT_DIR]        (default target/gpu-bin; PROFILE=dev for a debug build)
#
# What it builds (each step: `add NAME KIND WHAT PATH` into the folder and its MANIFEST):
#   odc_transport_lib          the odc-transport unit tests with --features cuda,conformance
#                              (run.sh runs `cuda::`: kernels compiled by NVRTC, exact adds, copies)
#   cuda_conformance           the conformance suite, owner and reader in one process
#   cuda_process_conformance   the conformance suite, owner in a child process (CUDA IPC)
#   odc-conformance-owner      that child (run.sh points ODC_CONFORMANCE_OWNER at it)
#   odc-bench                  `odc-bench transport --backends cuda`
#   odc_actors_lib             the odc-actors unit tests with --features cuda (run.sh runs
#                              `server::device`: the GPU store against the host store)
#   gpu_servers                a whole job with shard servers on the GPU against the host (I3)
# Later parts (candle on CUDA) add their binaries with more `add` lines.
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

add() { # NAME KIND WHAT PATH
  local name="$1" kind="$2" what="$3" path="$4"
  if [ ! -x "$path" ]; then
    echo "build.sh: $name: no executable at $path" >&2
    exit 1
  fi
  cp "$path" "$OUT_DIR/$name"
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

echo "build.sh: $(($(date +%s) - started)) s; $OUT_DIR:"
cat "$manifest"
du -sh "$OUT_DIR"
