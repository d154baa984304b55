#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and `llama-bench`, `llama-quantize`) from the source that the
# llama-cpp-python sdist vendors, for the side-by-side benchmarks only (never needed by `make run`
# or `make test`). benchmarks/peers.py calls it when the binaries are missing.
#
#   benchmarks/peers/build_llama_server.sh [VERSION]      (default 0.3.36)
#
# Result: $KVPAGE_PEERS_DIR/llama.cpp-<version>/build/bin/llama-server (default dir ~/.cache/kvpage/peers),
# built for this machine's CPU (GGML_NATIVE=ON), CPU backend only, with the build flags written to
# build/BUILD_INFO.txt beside it.
set -euo pipefail
VERSION="${1:-0.3.36}"
DIR="${KVPAGE_PEERS_DIR:-$HOME/.cache/kvpage/peers}"
PY="${PYTHON:-python3}"
SRC="$DIR/llama.cpp-$VERSION"
mkdir -p "$DIR"
if [ -x "$SRC/build/bin/llama-server" ] && [ -x "$SRC/build/bin/llama-quantize" ]; then
  echo "$SRC/build/bin/llama-server"; exit 0
fi
if [ ! -d "$SRC" ]; then
  tmp="$(mktemp -d)"
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$VERSION"
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  rm -rf "$tmp"
fi
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF)
cmake -S "$SRC" -B "$SRC/build" "${FLAGS[@]}" >/dev/null
cmake --build "$SRC/build" --target llama-server llama-bench llama-quantize -j "$(nproc)"
{
  echo "llama-cpp-python sdist $VERSION (vendored llama.cpp)"
  echo "cmake flags: ${FLAGS[*]}"
  "$SRC/build/bin/llama-server" --version 2>&1 | head -3
} >"$SRC/build/BUILD_INFO.txt"
echo "$SRC/build/bin/llama-server"
