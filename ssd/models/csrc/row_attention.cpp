// Row-invariant paged attention on CPU: every (query row, head) by a fixed sequence of its own, so a token's
// result is bitwise the same in a decode step, a verification, a prefill chunk or any batch, at any thread count.
// Documented in ssd/models/row_attention.py.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <algorithm>
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

// The lane sums of 16 vectors as one vector (lane k: the sum of d[k]'s 16 lanes), added in exactly the pairs of
// _mm512_reduce_add_ps (lanes j and j + 8, then j and j + 4, then j and j + 2, then the two left), so each sum
// has the bits that reduction gives it, for 15 additions and 30 permutations instead of 16 reductions.
inline __m512 reduce16(const __m512* d) {
  const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i by4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i by2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i by1 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const auto pairs = [](__m512 a, __m512 b, __m512i first, int step) {  // lanes first[i] + lanes first[i] + step
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(step));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, first, b), _mm512_permutex2var_ps(a, second, b));
  };
  __m512 u[8], v[4], w[2];
  for (int p = 0; p < 8; ++p) u[p] = pairs(d[2 * p], d[2 * p + 1], lo8, 8);  // [d[2p]'s 8 sums, d[2p+1]'s]
  for (int p = 0; p < 4; ++p) v[p] = pairs(u[2 * p], u[2 * p + 1], by4, 4);  // 4 sums of each of 4 vectors
  for (int p = 0; p < 2; ++p) w[p] = pairs(v[2 * p], v[2 * p + 1], by2, 2);  // 2 sums of each of 8 vectors
  return pairs(w[0], w[1], by1, 1);
}

// A (query row, head) of one sequence: where its vectors are and which mask row says what it sees.
struct RowHead {
  const float* q;  // query vector
  float* o;        // output vector
  int64_t row;     // index into the sequence's rows (mask row)
};

// A thread's working memory, reused across the (sequence, KV head)s it takes.
struct Scratch {
  std::vector<int64_t> count;  // per row: how many keys it sees (-1: not yet listed)
  std::vector<int64_t> seen;   // per row: the cache offsets of the keys it sees, in key order [Q, L]
  std::vector<float> scores;   // per item: its scores, then its softmax weights [items, L]
  std::vector<float> acc;      // per item: its weighted sum of values [items, D]
  std::vector<float> denom;    // per item: its softmax's denominator
};

// Every query row of one sequence and every head of one KV head (head size a multiple of 16). Each (row, head)
// runs alone over the keys its row sees, in key order: scores 16 keys at a time (per key a fused multiply-add
// per 16-wide chunk of the head, then the lane sums of the 16 keys by reduce16, times the scale), the softmax
// above, and the values accumulated in key order. Both passes go 16 visible keys at a time across all items,
// so a block of keys (or values) comes from memory once and is reused from the first-level cache by every row
// and head that sees it (the rows of a verification share their prefix).
template <int64_t chunks>  // head size / 16, a constant so that the chunk loops unroll into registers
void attend_group_vector(const float* k_p, const float* v_p, int64_t Hkv, int64_t kvh, const int64_t* slots,
                         int64_t L, const bool* const* visible, const std::vector<RowHead>& items, float s,
                         Scratch& scratch) {
  constexpr int64_t D = chunks * LANES;
  const int64_t Q = static_cast<int64_t>(scratch.count.size());
  scratch.seen.resize(static_cast<size_t>(Q * L));
  scratch.scores.resize(items.size() * static_cast<size_t>(L));
  scratch.acc.assign(items.size() * static_cast<size_t>(D), 0.f);
  scratch.denom.resize(items.size());
  std::fill(scratch.count.begin(), scratch.count.end(), -1);
  int64_t longest = 0;
  for (const RowHead& it : items) {  // the cache offsets of the keys each row sees, once per row
    int64_t& n = scratch.count[it.row];
    if (n >= 0) continue;
    int64_t* seen = scratch.seen.data() + it.row * L;
    n = 0;
    for (int64_t j = 0; j < L; ++j)
      if (visible[it.row] == nullptr || visible[it.row][j]) seen[n++] = (slots[j] * Hkv + kvh) * D;
    longest = std::max(longest, n);
  }
  const __m512 scale = _mm512_set1_ps(s);
  for (int64_t first = 0; first < longest; first += LANES) {
    for (size_t i = 0; i < items.size(); ++i) {
      const RowHead& it = items[i];
      const int64_t n = scratch.count[it.row], count = std::min(LANES, n - first);
      if (count <= 0) continue;
      const int64_t* seen = scratch.seen.data() + it.row * L + first;
      __m512 q[chunks], dots[LANES];
      for (int64_t c = 0; c < chunks; ++c) q[c] = _mm512_loadu_ps(it.q + c * LANES);
      for (int64_t k = 0; k < LANES; ++k) {
        if (k >= count) {
          dots[k] = _mm512_setzero_ps();
          continue;
        }
        const float* key = k_p + seen[k];
        __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
        for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(key + c * LANES), dot);
        dots[k] = dot;
      }
      _mm512_mask_storeu_ps(scratch.scores.data() + i * L + first, live_lanes(count),
                            _mm512_mul_ps(reduce16(dots), scale));
    }
  }
  for (size_t i = 0; i < items.size(); ++i)
    scratch.denom[i] = softmax_vector(scratch.scores.data() + i * L, scratch.count[items[i].row]);
  for (int64_t first = 0; first < longest; first += LANES) {
    for (size_t i = 0; i < items.size(); ++i) {
      const int64_t n = scratch.count[items[i].row], count = std::min(LANES, n - first);
      if (count <= 0) continue;
      const int64_t* seen = scratch.seen.data() + items[i].row * L + first;
      const float* weights = scratch.scores.data() + i * L + first;
      float* a = scratch.acc.data() + i * D;
      __m512 acc[chunks];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_loadu_ps(a + c * LANES);
      for (int64_t k = 0; k < count; ++k) {
        const __m512 w = _mm512_set1_ps(weights[k]);
        for (int64_t c = 0; c < chunks; ++c)
          acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v_p + seen[k] + c * LANES), acc[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(a + c * LANES, acc[c]);
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t n = scratch.count[items[i].row];
    const __m512 d = _mm512_set1_ps(n > 0 ? scratch.denom[i] : 1.f);
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(items[i].o + c * LANES,
                       n > 0 ? _mm512_div_ps(_mm512_loadu_ps(scratch.acc.data() + i * D + c * LANES), d)
                             : _mm512_setzero_ps());
  }
}
#endif
}  // namespace

namespace ssd {

at::Tensor row_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor kv_slots,
                         at::Tensor query_rows, std::optional<at::Tensor> mask, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
              value_cache.scalar_type() == at::kFloat, "row_attention: float32 tensors only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "row_attention: contiguous tensors only");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(1);
  const int64_t group = H / Hkv;
  const int64_t B = kv_slots.size(0), L = kv_slots.size(1), Q = query_rows.size(1);
  auto slots_t = kv_slots.contiguous();
  auto rows_t = query_rows.contiguous();
  at::Tensor mask_t;
  const bool* mask_p = nullptr;
  if (mask.has_value()) {
    mask_t = mask->contiguous();
    mask_p = mask_t.data_ptr<bool>();
  }
  auto out = at::zeros_like(query);
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
      Scratch scratch;
      scratch.count.resize(Q);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item % Hkv, b = item / Hkv;
        items.clear();
        for (int64_t q = 0; q < Q; ++q) {
          const int64_t t = row_p[b * Q + q];
          visible[q] = mask_p == nullptr ? nullptr : mask_p + (b * Q + q) * L;
          if (t < 0 || t >= T) continue;  // a padding row
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
            items.push_back({q_p + (t * H + h) * D, o_p + (t * H + h) * D, q});
        }
        if (items.empty()) continue;
        const int64_t* slots = slot_p + b * L;
        switch (D / LANES) {
#define SSD_RA_CASE(C) \
  case C: attend_group_vector<C>(k_p, v_p, Hkv, kvh, slots, L, visible.data(), items, s, scratch); break;
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

}  // namespace ssd
