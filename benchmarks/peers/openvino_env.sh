#!/usr/bin/env bash
# A virtual environment with Intel's OpenVINO GenAI and optimum-intel (its exporter), for the
# side-by-side benchmarks only (never needed by `make run` or `make test`); benchmarks/peers.py
# calls it when the environment is missing. Its own venv: optimum-intel pins a transformers of its
# own, which must not replace the one kvpage's oracle tests use. torch is the CPU build kvpage pins.
#
#   benchmarks/peers/openvino_env.sh [GENAI_VERSION]      (default 2026.4.1.0)
#
# Result (last line): the venv's python, $KVPAGE_PEERS_DIR/openvino-<version>/bin/python
# (default dir ~/.cache/kvpage/peers), with the installed versions in VERSIONS.txt beside bin/.
set -euo pipefail
VERSION="${1:-2026.4.1.0}"
DIR="${KVPAGE_PEERS_DIR:-$HOME/.cache/kvpage/peers}"
PY="${PYTHON:-python3}"
ENV="$DIR/openvino-$VERSION"
if [ -x "$ENV/bin/python" ] && [ -f "$ENV/VERSIONS.txt" ]; then
  echo "$ENV/bin/python"; exit 0
fi
mkdir -p "$DIR"
rm -rf "$ENV"
"$PY" -m venv "$ENV"
"$ENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$ENV/bin/python" -m pip install --quiet "torch==2.13.0" "openvino-genai==$VERSION" "optimum-intel[openvino]" gguf accelerate
# torchvision comes along built for another torch, and transformers' imports fail on it: the export needs none
"$ENV/bin/python" -m pip uninstall --quiet -y torchvision 2>/dev/null || true
"$ENV/bin/python" -m pip freeze | grep -i -E '^(openvino|openvino-genai|openvino-tokenizers|optimum|optimum-intel|transformers|torch|nncf)==' >"$ENV/VERSIONS.txt"
echo "$ENV/bin/python"
