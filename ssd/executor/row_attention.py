"""Row-invariant paged attention on CPU: each query row's result depends only on that row and the keys it sees.

PyTorch's SDPA sums in orders that depend on the call's shape (a decode step's single unmasked query, a
verification's masked rows, a prefill chunk), so the same token gets logits that differ in the last bits from
one kind of step to another. With float weights that is harmless; with activations quantized per row
(``"w8a8"`` targets, ``ssd/models/rowwise_int8.py``) a last-bit difference can flip a rounding step and grow
into a different token, so SD and SSD would stop reproducing AR. This kernel computes every (query row, head)
on its own, in one thread, in a fixed order: the dot products over the head dimension in 16 fixed lanes
combined pairwise, the scores of the visible keys in key order (masked keys are skipped, not added as zeros),
then the softmax and the weighted sum of values in key order. The result for a token is therefore bitwise the
same in a decode step, a verification, a prefill chunk or any batch, at any thread count.

The C++ source is compiled once per machine on first use (``ssd/models/native.py``; a C++ compiler and ninja
are needed); :func:`available` says whether that worked.
"""

from __future__ import annotations

import functools

import torch

from ssd.models.native import compiles, load_inline_source

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {
constexpr int64_t LANES = 16;

// Dot product in a fixed order: LANES independent running sums, then a fixed pairwise combine.
inline float fixed_dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    for (int64_t j = 0; j < LANES; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float tail = 0.f;
  for (; d < n; ++d) tail += a[d] * b[d];
  for (int64_t width = LANES / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0] + tail;
}
}  // namespace

torch::Tensor row_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor kv_slots, torch::Tensor query_rows, c10::optional<torch::Tensor> mask,
                            double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
              value_cache.scalar_type() == torch::kFloat32, "row_attention: float32 tensors only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "row_attention: contiguous tensors only");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(1);
  const int64_t group = H / Hkv;
  const int64_t B = kv_slots.size(0), L = kv_slots.size(1), Q = query_rows.size(1);
  auto slots_t = kv_slots.contiguous();
  auto rows_t = query_rows.contiguous();
  torch::Tensor mask_t;
  const bool* mask_p = nullptr;
  if (mask.has_value()) {
    mask_t = mask->contiguous();
    mask_p = mask_t.data_ptr<bool>();
  }
  auto out = torch::zeros_like(query);
  const float* q_p = query.data_ptr<float>();
  const float* k_p = key_cache.data_ptr<float>();
  const float* v_p = value_cache.data_ptr<float>();
  const int64_t* slot_p = slots_t.data_ptr<int64_t>();
  const int64_t* row_p = rows_t.data_ptr<int64_t>();
  float* o_p = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * Q * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L);
    std::vector<int64_t> seen(L);
    std::vector<float> acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % H, bq = item / H, b = bq / Q;
      const int64_t t = row_p[bq];
      if (t < 0 || t >= T) continue;  // a padding row
      const int64_t kvh = h / group;
      const float* qv = q_p + (t * H + h) * D;
      int64_t n = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        if (mask_p != nullptr && !mask_p[bq * L + j]) continue;
        const int64_t slot = slot_p[b * L + j];
        const float score = fixed_dot(qv, k_p + (slot * Hkv + kvh) * D, D) * s;
        scores[n] = score;
        seen[n] = slot;
        ++n;
        if (score > top) top = score;
      }
      float denom = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        scores[i] = std::exp(scores[i] - top);
        denom += scores[i];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float* vv = v_p + (seen[i] * Hkv + kvh) * D;
        const float w = scores[i];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * vv[d];
      }
      float* o = o_p + (t * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = n > 0 ? acc[d] / denom : 0.f;
    }
  });
  return out;
}
"""


@functools.cache
def _module():
    return load_inline_source("ssd_row_attention", _SOURCE, ["row_attention"])


@functools.cache
def available() -> bool:
    """Whether the kernel compiled (or was found compiled) on this machine; logs why not."""
    return compiles(_module, "row-invariant attention kernel")


def row_attention(
    query: torch.Tensor,  # [T, H, D] float32
    key_cache: torch.Tensor,  # [num_slots, Hkv, D] float32
    value_cache: torch.Tensor,  # [num_slots, Hkv, D] float32
    kv_slots: torch.Tensor,  # [B, L] int64
    query_rows: torch.Tensor,  # [B, Q] int64: row of the flat batch per padded query (>= T: padding)
    mask: torch.Tensor | None,  # [B, Q, L] bool (True: visible), None: every row sees all L slots
    scale: float,
) -> torch.Tensor:
    """Attention ``[T, H, D]`` of every query row over the slots it sees, each row computed on its own."""
    return _module().row_attention(query.contiguous(), key_cache, value_cache, kv_slots, query_rows, mask,
                                   float(scale))
