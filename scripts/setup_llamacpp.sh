#!/usr/bin/env bash
# Build llama-cpp-python (which compiles llama.cpp: ~10 minutes on 2 cores) once into a cached wheel and install
# it into an environment of its own, for the llama.cpp peer benchmark (bench/llamacpp_peer.py). Benchmarks
# only: CI never runs this. Then:
#   .venv-llamacpp/bin/python bench/llamacpp_peer.py --gguf PATH
# VENV=path to put the environment elsewhere; LLAMACPP_VERSION to pin another release.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-llamacpp}
VERSION=${LLAMACPP_VERSION:-0.3.36}
WHEELS=${SSD_CACHE_DIR:-$HOME/.cache/ssd-engine}/wheels
mkdir -p "$WHEELS"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  # llama.cpp's own CPU detection picks the instruction sets of this machine (GGML_NATIVE).
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/python" -m pip wheel --no-deps -w "$WHEELS" \
    "llama-cpp-python==$VERSION"
fi
"$VENV/bin/python" -m pip install -q "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
