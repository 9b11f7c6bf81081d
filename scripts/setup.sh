#!/usr/bin/env bash
# Create .venv (if missing) and install the engine with its test dependencies.
# torch is pinned to the CPU build available on this machine's package index; on a CUDA machine install the
# torch build you want first, then run this script (pip keeps an installed torch that satisfies the pin range).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,bench]"
