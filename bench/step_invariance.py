"""Does a model compute the same logits for a token however the step that carries it is shaped?

Every mode, batch size and K stays token-identical only if a token's logits do not depend on the step it rides
in: a decode step (one row), a verification (K + 1 rows) or a prefill chunk. This feeds the same tokens to the
engine's model forward three ways (a 20-token prefill, then 20 decode steps / four 5-row steps / one 20-row
chunk) and prints, per weight format, whether the logits of the last 20 tokens are bitwise equal and their
largest difference. ``--attention``: ``sdpa`` (the engine's default), ``kernel`` (the row-invariant kernel
that w8a8 targets use, ``ssd/models/row_attention.py``) or ``reference`` (each query row alone in float64,
slow: the differences that remain then come from the rest of the forward).

    python bench/step_invariance.py [--model PATH] [--formats fp16-packed,w8a8] [--attention kernel]

On the default target (2026-12-07): with SDPA fp16-packed differs by up to ~6e-5 between the paths, w8a8 by up
to 4.5 (per-row activation rounding amplifies attention's last bits); with the kernel or the reference, both
are bitwise equal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_steps import sequence_logits  # noqa: E402

import ssd.models.attention as attention  # noqa: E402
import ssd.models.decoder as decoder  # noqa: E402
from ssd.models.loader import load_model  # noqa: E402
from ssd.models.weight_formats import pack_weights  # noqa: E402
from ssd.options import WeightFormat  # noqa: E402

PREFIX, TAIL = 20, 20


def rowwise_attention(query, cache, meta, scale):
    """Reference attention: each query row alone over the slots its mask lets it see, in float64."""
    num_tokens, num_heads, _ = query.shape
    group = num_heads // cache.key.shape[-2]
    keys = attention.gather_slots(cache.key, meta.kv_slots)  # [B, L, Hkv, D]
    values = attention.gather_slots(cache.value, meta.kv_slots)  # [B, L, Hkv, D]
    out = torch.empty_like(query)
    for b in range(meta.query_rows.shape[0]):
        for i, row in enumerate(meta.query_rows[b].tolist()):
            if row >= num_tokens:
                continue  # padding
            visible = meta.mask[b, 0, i] if meta.mask is not None else slice(None)
            k, v = keys[b][visible].double(), values[b][visible].double()  # [l, Hkv, D]
            for h in range(num_heads):
                p = torch.softmax((k[:, h // group] @ query[row, h].double()) * scale, dim=0)  # [l]
                out[row, h] = (p @ v[:, h // group]).float()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the fetched SmolLM2-135M)")
    p.add_argument("--formats", default="fp16-packed,w8a8")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "kernel", "reference"])
    args = p.parse_args(argv)
    if args.model is None:
        from ssd.models.fetch import fetch_default_target

        args.model = str(fetch_default_target())
    if args.attention == "reference":
        attention.attend_cached = decoder.attend_cached = rowwise_attention

    torch.manual_seed(0)
    tokens = torch.randint(100, 5000, (PREFIX + TAIL,)).tolist()
    paths = {"decode": [PREFIX] + [1] * TAIL, "verify5": [PREFIX] + [5] * (TAIL // 5), "prefill": [PREFIX, TAIL]}
    with torch.inference_mode():
        for fmt in args.formats.split(","):
            model, _ = load_model(args.model, dtype=torch.float32)
            pack_weights(model, WeightFormat(fmt))
            logits = {name: sequence_logits(model, tokens, chunks, args.attention == "kernel")[PREFIX:]
                      for name, chunks in paths.items()}
            cells = []
            for name in ("verify5", "prefill"):
                diff = (logits[name] - logits["decode"]).abs().max().item()
                cells.append(f"{name} vs decode: {'bitwise equal' if diff == 0 else f'max diff {diff:.2e}'}")
            print(f"{fmt:12s} {'; '.join(cells)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
