"""Row-invariant paged attention on CPU: each query row's result depends only on that row and the keys it sees.

PyTorch's SDPA sums in orders that depend on the call's shape (a decode step's single unmasked query, a
verification's masked rows, a prefill chunk), so the same token gets logits that differ in the last bits from
one kind of step to another. With float weights that is harmless; with activations quantized per row
(``"w8a8"`` targets, ``ssd/models/rowwise_int8.py``) a last-bit difference can flip a rounding step and grow
into a different token, so SD and SSD would stop reproducing AR. This kernel computes every (query row, head)
by a fixed sequence of its own: the dot product with each visible key (masked keys are skipped, not added as
zeros), the softmax, and the weighted sum of values in key order. The result for a token is therefore bitwise
the same in a decode step, a verification, a prefill chunk or any batch, at any thread count.

With AVX-512 and a head size that is a multiple of 16, one thread takes all query rows of a sequence and all
heads of one KV head together, so each key and value is read once for all of them (a verification's rows
and GQA's heads), while each (row, head) still runs its own chain: a fused multiply-add per 16-wide chunk
of the head and one lane reduction per score, exponentials 16 keys at a time by one polynomial, values
accumulated in key order. Elsewhere a scalar path computes each (row, head) alone (16 fixed lanes combined
pairwise, ``std::exp``): different bits from the vector path, but one machine always runs the same path.

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

#if defined(__AVX512F__)
#include <immintrin.h>
#define SSD_RA_VECTOR 1
#else
#define SSD_RA_VECTOR 0
#endif

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

// One (query row, head) over its n visible keys (slots seen[0:n]), any head size.
void attend_scalar(const float* qv, const float* k_p, const float* v_p, int64_t Hkv, int64_t kvh, int64_t D,
                   const int64_t* seen, int64_t n, float s, float* scores, float* acc, float* o) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = fixed_dot(qv, k_p + (seen[i] * Hkv + kvh) * D, D) * s;
    if (scores[i] > top) top = scores[i];
  }
  float denom = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - top);
    denom += scores[i];
  }
  std::fill(acc, acc + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* vv = v_p + (seen[i] * Hkv + kvh) * D;
    const float w = scores[i];
    for (int64_t d = 0; d < D; ++d) acc[d] += w * vv[d];
  }
  for (int64_t d = 0; d < D; ++d) o[d] = n > 0 ? acc[d] / denom : 0.f;
}

#if SSD_RA_VECTOR
constexpr int64_t MAX_CHUNKS = 16;  // head sizes up to 256 take the vector path

// exp(x) for 16 lanes, each lane by the same operations (range reduction to r in [-ln2/2, ln2/2], a degree-6
// polynomial, scaling by 2^n), so a lane's result never depends on the others. Relative error ~2e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 live_lanes(int64_t left) {
  return static_cast<__mmask16>(left >= LANES ? 0xFFFF : (1u << left) - 1u);
}

// Softmax of one (query row, head)'s n scores in place (exponentials 16 keys at a time, the denominator in 16
// lanes by visible-key index); returns the denominator.
inline float softmax_vector(float* scores, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 live = live_lanes(n - i);
    top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, scores + i));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 live = live_lanes(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + i), shift));
    _mm512_mask_storeu_ps(scores + i, live, e);
    lanes = _mm512_mask_add_ps(lanes, live, lanes, e);
  }
  return _mm512_reduce_add_ps(lanes);
}

// Every query row of one sequence and every head of one KV head (head size a multiple of 16), reading each
// key and value once for all of them. A (row, head)'s result is still one fixed sequence of its own: each
// visible key's score is the same chain of fused multiply-adds over the head's 16-wide chunks and the same
// lane reduction, the softmax above, and the values accumulated in key order.
struct RowHead {
  const float* q;  // query vector
  float* o;        // output vector
  int64_t row;     // index into the sequence's rows (mask row)
  int64_t n;       // visible keys so far
  float denom;     // the softmax's denominator
};

// For each slot in order, its 16-wide chunks of ``cache`` (keys or values) in registers, then
// body(i, item, x, k) for every item that sees it, k being the slot's index among the ones item sees.
template <int64_t chunks, typename Body>
inline void for_each_visible(const float* cache, int64_t Hkv, int64_t kvh, const int64_t* slots, int64_t L,
                             const bool* const* visible, std::vector<RowHead>& items, Body body) {
  constexpr int64_t D = chunks * LANES;
  __m512 x[chunks];
  for (RowHead& it : items) it.n = 0;
  for (int64_t j = 0; j < L; ++j) {
    const float* row = cache + (slots[j] * Hkv + kvh) * D;
    for (int64_t c = 0; c < chunks; ++c) x[c] = _mm512_loadu_ps(row + c * LANES);
    for (size_t i = 0; i < items.size(); ++i) {
      RowHead& it = items[i];
      if (visible[it.row] == nullptr || visible[it.row][j]) body(static_cast<int64_t>(i), it, x, it.n++);
    }
  }
}

template <int64_t chunks>  // head size / 16, a constant so that the chunk loops unroll and x stays in registers
void attend_group_vector(const float* k_p, const float* v_p, int64_t Hkv, int64_t kvh, const int64_t* slots,
                         int64_t L, const bool* const* visible, std::vector<RowHead>& items, float s,
                         std::vector<float>& scores, std::vector<float>& acc) {
  constexpr int64_t D = chunks * LANES;
  scores.resize(items.size() * static_cast<size_t>(L));
  acc.assign(items.size() * static_cast<size_t>(D), 0.f);
  for_each_visible<chunks>(k_p, Hkv, kvh, slots, L, visible, items,
                           [&](int64_t i, RowHead& it, const __m512* x, int64_t k) {
    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(it.q), x[0]);
    for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(it.q + c * LANES), x[c], dot);
    scores[i * L + k] = _mm512_reduce_add_ps(dot) * s;
  });
  for (size_t i = 0; i < items.size(); ++i) items[i].denom = softmax_vector(scores.data() + i * L, items[i].n);
  for_each_visible<chunks>(v_p, Hkv, kvh, slots, L, visible, items,
                           [&](int64_t i, RowHead&, const __m512* x, int64_t k) {
    const __m512 w = _mm512_set1_ps(scores[i * L + k]);
    float* a = acc.data() + i * D;
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(a + c * LANES, _mm512_fmadd_ps(w, x[c], _mm512_loadu_ps(a + c * LANES)));
  });
  for (size_t i = 0; i < items.size(); ++i) {
    const RowHead& it = items[i];
    const __m512 d = _mm512_set1_ps(it.n > 0 ? it.denom : 1.f);
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(it.o + c * LANES,
                       it.n > 0 ? _mm512_div_ps(_mm512_loadu_ps(acc.data() + i * D + c * LANES), d)
                                : _mm512_setzero_ps());
  }
}
#endif
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
#if SSD_RA_VECTOR
  if (D % LANES == 0 && D / LANES <= MAX_CHUNKS) {
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<RowHead> items;
      std::vector<const bool*> visible(Q);
      std::vector<float> scores, acc;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item % Hkv, b = item / Hkv;
        items.clear();
        for (int64_t q = 0; q < Q; ++q) {
          const int64_t t = row_p[b * Q + q];
          visible[q] = mask_p == nullptr ? nullptr : mask_p + (b * Q + q) * L;
          if (t < 0 || t >= T) continue;  // a padding row
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
            items.push_back({q_p + (t * H + h) * D, o_p + (t * H + h) * D, q, 0, 0.f});
        }
        if (items.empty()) continue;
        const int64_t* slots = slot_p + b * L;
        switch (D / LANES) {
#define SSD_RA_CASE(C) \
  case C: attend_group_vector<C>(k_p, v_p, Hkv, kvh, slots, L, visible.data(), items, s, scores, acc); break;
          SSD_RA_CASE(1) SSD_RA_CASE(2) SSD_RA_CASE(3) SSD_RA_CASE(4) SSD_RA_CASE(5) SSD_RA_CASE(6) SSD_RA_CASE(7)
          SSD_RA_CASE(8) SSD_RA_CASE(9) SSD_RA_CASE(10) SSD_RA_CASE(11) SSD_RA_CASE(12) SSD_RA_CASE(13)
          SSD_RA_CASE(14) SSD_RA_CASE(15) SSD_RA_CASE(16)
#undef SSD_RA_CASE
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, B * Q * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L);
    std::vector<int64_t> seen(L);
    std::vector<float> acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % H, bq = item / H, b = bq / Q;
      const int64_t t = row_p[bq];
      if (t < 0 || t >= T) continue;  // a padding row
      int64_t n = 0;
      for (int64_t j = 0; j < L; ++j) {
        if (mask_p != nullptr && !mask_p[bq * L + j]) continue;
        seen[n++] = slot_p[b * L + j];
      }
      attend_scalar(q_p + (t * H + h) * D, k_p, v_p, Hkv, h / group, D, seen.data(), n, s, scores.data(),
                    acc.data(), o_p + (t * H + h) * D);
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
