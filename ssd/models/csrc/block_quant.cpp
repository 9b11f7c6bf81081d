// Block-quantized products on CPU: y = x @ W.T with W held in blocks of 32 weights sharing one float16 scale
// (q8_0: int8 values; q4_0: 4-bit values minus 8; q4_1: 4-bit values and a float16 minimum, w = d * q + m;
// q4_k: 4-bit values, w = (d * s) * q - (dmin * m) with 6-bit s, m per block and d, dmin per 256; as GGUF
// stores them) and x quantized to int8 in blocks of 32 per row (one float scale per block, as llama.cpp
// quantizes its activations). Documented in block_quant.py.
//
// Layout: output channels in groups of 16, one per 32-bit lane of an AVX-512 register, so one VNNI
// instruction adds 4 products to each of 16 channels and a block of 32 inputs is 8 instructions per row
// whatever the row count: the weights are read once per group and reused by every row of a pass (up to 12)
// from registers, and the per-block float work (convert, scale, add) is shared by 16 channels. A group's
// weights are one sequential stream of 64-input chunks:
//   [chunk] = [scales: block 0's 16 float16, block 1's 16 float16] ([minimums, likewise: q4_1])
//             [block 0 values] [block 1 values]
//   q4_k: [the super-block's 16 d, 16 -dmin (float16)] [16 + 16 scale bytes] [16 + 16 minimum bytes] [values]
//   q8_0 block values: 8 x 64 bytes; vector t, lane j = channel j's inputs 4t..4t+3 as unsigned q + 128;
//   4-bit block values: 4 x 64 bytes; vector v, lane j, byte i: low nibble = channel j's input 4v + i,
//   high nibble = its input 16 + 4v + i, each q in 0..15 (q4_0: meaning q - 8).
// Weights are unsigned and activations signed (the broadcast operand of VNNI is the signed one); the offset
// (128 or 8) times the activations' block sum is subtracted once per row and block; q4_1 adds instead its
// minimum times the activations' block sum times their scale; q4_k's block scale d * s and minimum
// -dmin * m are exact float products, formed per block and group before the rows use them.
//
// The arithmetic of one output (row r, channel n) is fixed whatever else shares the call: for each block b in
// order, the exact int32 sum t_b = sum(u * a) - offset * sum(a), then acc = fma(float(t_b), d_w * s_a, acc)
// with d_w * s_a rounded to float first (q4_1, q4_k: then acc = fma(m_w, s_a * sum(a), acc)). The vector path and
// the portable path perform exactly these operations, so they agree bitwise, and a row's result never depends
// on the number or values of other rows.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define SSD_BQ_VECTOR 1
#else
#define SSD_BQ_VECTOR 0
#endif

namespace {

constexpr int64_t BLOCK = 32;   // weights (and activations) sharing one scale
constexpr int64_t CHUNK = 64;   // inputs per chunk of the stream: two blocks
constexpr int64_t GROUP = 16;   // output channels per group: one per lane
constexpr int64_t SCALE_BYTES = 2 * GROUP * 2;  // a chunk's float16 scales (q4_1, q4_k: as many again)

enum Kind : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3 };  // as BlockKind.code in block_quant.py

constexpr bool nibbles(Kind kind) { return kind != Q8_0; }
constexpr int32_t offset(Kind kind) { return kind == Q8_0 ? 128 : kind == Q4_0 ? 8 : 0; }
constexpr bool has_min(Kind kind) { return kind == Q4_1 || kind == Q4_K; }
inline int64_t block_value_bytes(Kind kind) { return GROUP * (nibbles(kind) ? BLOCK / 2 : BLOCK); }
inline int64_t values_at(Kind kind) { return has_min(kind) ? 2 * SCALE_BYTES : SCALE_BYTES; }
inline int64_t chunk_bytes(Kind kind) { return values_at(kind) + 2 * block_value_bytes(kind); }

// The rows, quantized, block-major so that the rows of one block sit together: a [blocks, m, 32] int8, and
// per (block, row) its scale, -offset x the block's sum of a, and scale x the block's sum of a (the minimum of
// q4_1 and q4_k multiplies it). A pass over rows r0.. then reaches every row of a block at a fixed offset from
// one pointer, instead of holding a pointer per row.
struct Rows {
  const int8_t* a;
  const float* scale;
  const int32_t* corr;
  const float* scaled_sum;
  int64_t m;
  int64_t blocks;
  int64_t cell(int64_t r, int64_t b) const { return b * m + r; }  // index of (row, block) in the tables
  const int8_t* values(int64_t r, int64_t b) const { return a + cell(r, b) * BLOCK; }
};

struct Stream {  // the packed weights
  const uint8_t* packed;
  int64_t chunks;
  int64_t chunk_bytes;
  const uint8_t* chunk(int64_t group, int64_t c) const { return packed + (group * chunks + c) * chunk_bytes; }
};

// Row r = x[0:k] as int8 in blocks of 32 (zero beyond k), each block's scale and correction, into the tables
// of rows (block-major, as Rows reads them).
void quantize_row(const float* x, int64_t k, int64_t r, int32_t offset, int8_t* a, float* s, int32_t* corr,
                  float* scaled_sum, const Rows& rows) {
  for (int64_t b = 0; b < rows.blocks; ++b) {
    const int64_t lo = b * BLOCK;
    float amax = 0.f;
    for (int64_t i = lo; i < std::min(lo + BLOCK, k); ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    const int64_t cell = rows.cell(r, b);
    for (int64_t i = lo; i < lo + BLOCK; ++i) {
      const float q = i < k ? std::nearbyint(x[i] * inv) : 0.f;
      a[cell * BLOCK + i - lo] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, q)));
      sum += a[cell * BLOCK + i - lo];
    }
    s[cell] = scale;
    corr[cell] = -offset * sum;
    scaled_sum[cell] = scale * static_cast<float>(sum);
  }
}

// Weight u (unsigned, offset included) of lane j, input i of a block's values.
inline int32_t weight_at(const uint8_t* values, Kind kind, int64_t j, int64_t i) {
  if (!nibbles(kind)) return values[(i / 4) * 64 + j * 4 + i % 4];
  const int64_t low = i % 16;
  const uint8_t byte = values[(low / 4) * 64 + j * 4 + low % 4];
  return i < 16 ? (byte & 0x0F) : (byte >> 4);
}

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

void group_portable(const Stream& w, Kind kind, int64_t group, const Rows& rows, int64_t m, float* out,
                    int64_t n_out) {
  for (int64_t j = 0; j < GROUP && group * GROUP + j < n_out; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < rows.blocks; ++b) {
        const uint8_t* chunk = w.chunk(group, b / 2);
        const uint8_t* values = chunk + values_at(kind) + (b % 2) * block_value_bytes(kind);
        const int8_t* a = rows.values(r, b);
        int32_t t = rows.corr[rows.cell(r, b)];
        for (int64_t i = 0; i < BLOCK; ++i) t += weight_at(values, kind, j, i) * a[i];
        float d, min;
        if (kind == Q4_K) {
          const int64_t byte = SCALE_BYTES + (b % 2) * GROUP + j;
          d = half_at(chunk + 2 * j) * static_cast<float>(chunk[byte]);
          min = half_at(chunk + 2 * (GROUP + j)) * static_cast<float>(chunk[byte + 2 * GROUP]);
        } else {
          const int64_t cell = ((b % 2) * GROUP + j) * 2;
          d = half_at(chunk + cell);
          min = kind == Q4_1 ? half_at(chunk + SCALE_BYTES + cell) : 0.f;
        }
        const float s = d * rows.scale[rows.cell(r, b)];
        acc = std::fma(static_cast<float>(t), s, acc);
        if (has_min(kind)) acc = std::fma(min, rows.scaled_sum[rows.cell(r, b)], acc);
      }
      out[r * n_out + group * GROUP + j] = acc;
    }
  }
}

#if SSD_BQ_VECTOR
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead of the pass each group's stream is fetched

inline __m512 halves16(const uint8_t* p) {  // 16 float16 as float
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 bytes16(const uint8_t* p) {  // 16 unsigned bytes as float
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512i broadcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Rows [r0, r0 + R) times one group: the accumulators stay in registers for the whole input, and the group's
// weights are read once, as one sequential stream (consecutive groups: one stream over the whole matrix).
template <Kind K, int R>
void tile(const Stream& w, int64_t group, const Rows& rows, int64_t r0, float* out, int64_t n_out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < w.chunks; ++c) {
    const uint8_t* chunk = w.chunk(group, c);
    for (int64_t line = 0; line < w.chunk_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(chunk + PREFETCH_BYTES + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const int64_t b = 2 * c + h;
      const int64_t cell = rows.cell(r0, b);  // rows r0 + r of block b: cell + r
      const int8_t* a = rows.a + cell * BLOCK;  // row r0 + r's inputs: a + r * BLOCK
      __m512i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm512_set1_epi32(rows.corr[cell + r]);
      const uint8_t* values = chunk + values_at(K) + h * block_value_bytes(K);
      // the loops below are unrolled whole, or GCC keeps a loop with its accumulators in memory from R = 6 on
      if constexpr (nibbles(K)) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m512i packed = _mm512_loadu_si512(values + 64 * v);
          const __m512i low = _mm512_and_si512(packed, nibble);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) {
            sums[r] = _mm512_dpbusd_epi32(sums[r], low, broadcast4(a + r * BLOCK + 4 * v));
            sums[r] = _mm512_dpbusd_epi32(sums[r], high, broadcast4(a + r * BLOCK + 16 + 4 * v));
          }
        }
      } else {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m512i u = _mm512_loadu_si512(values + 64 * t);
#pragma GCC unroll 12
          for (int r = 0; r < R; ++r) sums[r] = _mm512_dpbusd_epi32(sums[r], u, broadcast4(a + r * BLOCK + 4 * t));
        }
      }
      __m512 d, mins = _mm512_setzero_ps();
      if constexpr (K == Q4_K) {
        d = _mm512_mul_ps(halves16(chunk), bytes16(chunk + SCALE_BYTES + h * GROUP));
        mins = _mm512_mul_ps(halves16(chunk + 2 * GROUP), bytes16(chunk + SCALE_BYTES + (2 + h) * GROUP));
      } else {
        d = halves16(chunk + h * 2 * GROUP);
        if constexpr (K == Q4_1) mins = halves16(chunk + SCALE_BYTES + h * 2 * GROUP);
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(rows.scale[cell + r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), s, acc[r]);
        if constexpr (has_min(K)) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(rows.scaled_sum[cell + r]), acc[r]);
      }
    }
  }
  const int64_t first = group * GROUP;
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(GROUP, n_out - first)) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * n_out + first, mask, acc[r]);
}

// Rows sharing one pass over a group's weights: 12 accumulators and 12 partial sums fit the 32 vector registers.
// More rows take more passes, of equal size, over weights then in the first-level cache. A pass of more rows
// is compute-bound (on Zen 4 one VNNI instruction per cycle: ~0.75 ms per row over the 135M model's 113 MB of
// q8_0 weights, against ~6 ms to stream them), so the count is as many as registers allow.
constexpr int64_t MAX_R = 12;

template <Kind K>
void rows_vector(const Stream& w, int64_t group, const Rows& rows, int64_t r0, int64_t count, float* out,
                 int64_t n_out) {
  switch (count) {
    case 1: tile<K, 1>(w, group, rows, r0, out, n_out); break;
    case 2: tile<K, 2>(w, group, rows, r0, out, n_out); break;
    case 3: tile<K, 3>(w, group, rows, r0, out, n_out); break;
    case 4: tile<K, 4>(w, group, rows, r0, out, n_out); break;
    case 5: tile<K, 5>(w, group, rows, r0, out, n_out); break;
    case 6: tile<K, 6>(w, group, rows, r0, out, n_out); break;
    case 7: tile<K, 7>(w, group, rows, r0, out, n_out); break;
    case 8: tile<K, 8>(w, group, rows, r0, out, n_out); break;
    case 9: tile<K, 9>(w, group, rows, r0, out, n_out); break;
    case 10: tile<K, 10>(w, group, rows, r0, out, n_out); break;
    case 11: tile<K, 11>(w, group, rows, r0, out, n_out); break;
    default: tile<K, MAX_R>(w, group, rows, r0, out, n_out); break;
  }
}

template <Kind K>
void group_vector(const Stream& w, int64_t group, const Rows& rows, int64_t m, float* out, int64_t n_out) {
  const int64_t passes = (m + MAX_R - 1) / MAX_R, per_pass = (m + passes - 1) / passes;
  for (int64_t r0 = 0; r0 < m; r0 += per_pass)
    rows_vector<K>(w, group, rows, r0, std::min(per_pass, m - r0), out, n_out);
}
#endif

}  // namespace

namespace ssd {

bool block_quant_vectorized() { return SSD_BQ_VECTOR != 0; }

// x [m, k] float32; packed [groups, chunks * chunk bytes] uint8 in the layout above (kp = 64 * chunks >= k
// inputs, padding with zero scales). Returns [m, n_out] float32, n_out <= 16 * groups. portable: take the
// portable path even where the vector one was compiled (tests compare them).
at::Tensor block_quant_linear(at::Tensor x, at::Tensor packed, int64_t kind_code, int64_t n_out, bool portable) {
  TORCH_CHECK(kind_code >= Q8_0 && kind_code <= Q4_K, "block_quant_linear: unknown block kind ", kind_code);
  const Kind kind = static_cast<Kind>(kind_code);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_quant_linear: x must be 2-D float32");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "block_quant_linear: packed weights must be contiguous 2-D uint8");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0);
  TORCH_CHECK(packed.size(1) % chunk_bytes(kind) == 0, "block_quant_linear: packed rows are not whole chunks");
  const Stream w{packed.data_ptr<uint8_t>(), packed.size(1) / chunk_bytes(kind), chunk_bytes(kind)};
  const int64_t kp = w.chunks * CHUNK;
  TORCH_CHECK(k <= kp && n_out <= groups * GROUP, "block_quant_linear: x or n_out larger than the weights");
  auto xc = x.contiguous();
  auto out = at::empty({m, n_out}, x.options());
  if (m == 0 || n_out == 0) return out;
  const int64_t blocks = kp / BLOCK;
  std::vector<int8_t> a(static_cast<size_t>(m * kp));
  std::vector<float> scale(static_cast<size_t>(m * blocks));
  std::vector<int32_t> corr(static_cast<size_t>(m * blocks));
  std::vector<float> scaled_sum(static_cast<size_t>(m * blocks));
  const Rows rows{a.data(), scale.data(), corr.data(), scaled_sum.data(), m, blocks};
  const float* x_p = xc.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    quantize_row(x_p + r * k, k, r, offset(kind), a.data(), scale.data(), corr.data(), scaled_sum.data(), rows);
  float* out_p = out.data_ptr<float>();
  const int64_t live_groups = (n_out + GROUP - 1) / GROUP;
#if SSD_BQ_VECTOR
  if (!portable) {
    at::parallel_for(0, live_groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        switch (kind) {
          case Q8_0: group_vector<Q8_0>(w, g, rows, m, out_p, n_out); break;
          case Q4_0: group_vector<Q4_0>(w, g, rows, m, out_p, n_out); break;
          case Q4_1: group_vector<Q4_1>(w, g, rows, m, out_p, n_out); break;
          case Q4_K: group_vector<Q4_K>(w, g, rows, m, out_p, n_out); break;
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, live_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) group_portable(w, kind, g, rows, m, out_p, n_out);
  });
  return out;
}

}  // namespace ssd
