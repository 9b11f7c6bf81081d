"""GGUF test data that the gguf package cannot make: valid blocks of types it has no quantizer for."""

from __future__ import annotations

import numpy as np


def random_q4_k(out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K bytes [out, in / 256 * 144]: random 6-bit scales, minimums and nibbles, small positive
    super-block d and dmin (gguf has no Q4_K quantizer)."""
    rng = np.random.default_rng(seed)
    supers = in_features // 256
    raw = rng.integers(0, 256, size=(out_features, supers, 144), dtype=np.uint8)
    d_dmin = (rng.random((out_features, supers, 2)) * 2e-3 + 1e-4).astype(np.float16)
    raw[..., :4] = d_dmin.view(np.uint8).reshape(out_features, supers, 4)
    return raw.reshape(out_features, -1)
