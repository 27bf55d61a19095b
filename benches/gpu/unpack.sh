#!/usr/bin/env bash
# Unpacks the binaries benches/gpu/build.sh packed in FOLDER into DEST (made if missing), as
# executables: bin.tar.xz (one solid archive: the candle binaries share most of their bytes,
# candle's CUDA kernels, which a solid archive stores once), any NAME.xz, and plain executables;
# MANIFEST is copied too. Uses xz and tar where the machine has them, else Python's lzma and
# tarfile (the GPU machine has python3).
#
#   benches/gpu/unpack.sh FOLDER DEST
#
# Exit status: 0 when everything unpacked, 2 otherwise, saying what.
set -uo pipefail
FOLDER="$1"
DEST="$2"
mkdir -p "$DEST" || exit 2
PYTHON="${PYTHON:-python3}"

if [ -f "$FOLDER/bin.tar.xz" ]; then
  if command -v xz >/dev/null 2>&1 && command -v tar >/dev/null 2>&1; then
    xz -dc "$FOLDER/bin.tar.xz" | tar -x -C "$DEST"
  else
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
      "$FOLDER/bin.tar.xz" "$DEST"
  fi || { echo "unpack.sh: cannot unpack $FOLDER/bin.tar.xz" >&2; exit 2; }
fi
for packed in "$FOLDER"/*.xz; do
  [ -e "$packed" ] || continue
  case "$packed" in *.tar.xz) continue ;; esac
  name="$(basename "$packed" .xz)"
  if command -v xz >/dev/null 2>&1; then
    xz -dc "$packed" >"$DEST/$name"
  else
    "$PYTHON" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$packed" "$DEST/$name"
  fi || { echo "unpack.sh: cannot unpack $packed" >&2; exit 2; }
done
same() { [ "$(cd "$1" && pwd)" = "$(cd "$2" && pwd)" ]; }
for plain in "$FOLDER"/*; do
  [ -f "$plain" ] && [ -x "$plain" ] || continue
  case "$plain" in *.xz) continue ;; esac
  same "$FOLDER" "$DEST" || cp "$plain" "$DEST/"
done
if [ -f "$FOLDER/MANIFEST" ] && ! same "$FOLDER" "$DEST"; then
  cp "$FOLDER/MANIFEST" "$DEST/MANIFEST"
fi
for f in "$DEST"/*; do
  [ -f "$f" ] && [ "$(basename "$f")" != MANIFEST ] && chmod +x "$f"
done
exit 0
