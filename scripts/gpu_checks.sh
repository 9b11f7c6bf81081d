#!/usr/bin/env bash
# Issue 8's GPU checks in one command, on a CUDA machine whose Python already has PyTorch, Triton and
# transformers (nothing is installed): the CUDA-only tests (graphs, samplers, attention, the fused Triton
# kernels compiled), then bench/gpu_check.py (exactness, AR == SD == SSD, timing against the bandwidth floor).
# Logs and the JSON report go to $OUT (default bench/results); arguments go to gpu_check.py.
#
#   bash scripts/gpu_checks.sh --profile  # PYTHON=... to choose the interpreter (default python3)
#
# Each stage has a time limit (SIGABRT, so Python's faulthandler prints where it hung); the exit status is
# non-zero when any stage fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "devices", torch.cuda.device_count())' || exit 1

timeout -s ABRT -k 10 "${TEST_LIMIT_S:-180}" "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_cuda_graphs.py tests/test_rejection.py tests/test_sampler.py tests/test_attention_backends.py \
    tests/test_gpu_check.py tests/test_fused_kernels.py 2>&1 | tee "$out/gpu_tests.log" || status=1

timeout -s ABRT -k 10 "${CHECK_LIMIT_S:-300}" "$py" bench/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 \
    | tee "$out/gpu_check.log" || status=1
exit $status
