// Block-quantized products on CPU: y = x @ W.T with W held in blocks of 32 weights sharing one float16 scale
// (q8_0: int8 values; q4_0: 4-bit values minus 8, as GGUF stores them) and x quantized to int8 in blocks of 32
// per row (one float scale per block, as llama.cpp quantizes its activations). Documented in block_quant.py.
//
// The arithmetic of one output (row r, channel n) is fixed whatever else shares the call: its 64-element
// chunks are visited in order; each chunk gives 16 exact int32 lane sums (4 products each, lanes 0-7 from the
// first block, 8-15 from the second), each lane is converted to float, multiplied by its block's weight scale
// times activation scale and added with one fused multiply-add to its own lane accumulator; the 16 lanes are
// combined pairwise at the end. The AVX-512 VNNI path and the portable path perform exactly these operations,
// so they agree bitwise, and a row's result never depends on the number or the values of the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define SSD_BQ_VECTOR 1
#else
#define SSD_BQ_VECTOR 0
#endif

namespace {

constexpr int64_t BLOCK = 32;     // weights (and activations) sharing one scale
constexpr int64_t CHUNK = 64;     // elements per step: two blocks
constexpr int64_t LANES = 16;     // int32 lane sums per chunk
constexpr int64_t TILE_N = 4;     // output channels sharing one pass over the rows (weights padded to it)
constexpr int64_t TILE_R = 4;     // up to this many rows keep their accumulators in registers

// Weights are stored tile-major, so that a tile's pass over the input reads one sequential stream:
// [tile][chunk][channel of the tile][chunk bytes: 32 (q4) or 64 (q8)], scales [tile][chunk][channel][2].
inline const uint8_t* chunk_values(const uint8_t* qs, bool q4, int64_t chunks, int64_t tile, int64_t c, int64_t n) {
  return qs + ((tile * chunks + c) * TILE_N + n) * (q4 ? CHUNK / 2 : CHUNK);
}
inline const at::Half* chunk_scales(const at::Half* d, int64_t chunks, int64_t tile, int64_t c, int64_t n) {
  return d + ((tile * chunks + c) * TILE_N + n) * 2;
}

// Accumulators of one tile of channels: [row][TILE_N][LANES] floats.
inline float* row_acc(float* acc, int64_t r, int64_t n) { return acc + (r * TILE_N + n) * LANES; }

// The portable path: one channel's chunk as int8 weights in element order, -128 x (the sum of each lane's four
// weights) (activations are stored as unsigned q + 128) and each lane's block scale.
struct Prepared {
  int8_t w[CHUNK];
  int32_t neg_corr[LANES];
  float d[LANES];
};

void prepare_scalar(const uint8_t* qs, const at::Half* d, bool q4, int64_t chunks, int64_t tile, int64_t c,
                    int64_t n, Prepared& p) {
  const uint8_t* src = chunk_values(qs, q4, chunks, tile, c, n);
  if (q4) {
    for (int64_t j = 0; j < CHUNK / 2; ++j) {
      p.w[j] = static_cast<int8_t>((src[j] & 0x0F) - 8);
      p.w[j + CHUNK / 2] = static_cast<int8_t>((src[j] >> 4) - 8);
    }
  } else {
    std::memcpy(p.w, src, CHUNK);
  }
  for (int64_t l = 0; l < LANES; ++l) {
    int32_t sum = 0;
    for (int64_t k = 0; k < 4; ++k) sum += p.w[4 * l + k];
    p.neg_corr[l] = -128 * sum;
  }
  const at::Half* dn = chunk_scales(d, chunks, tile, c, n);
  for (int64_t l = 0; l < LANES; ++l) p.d[l] = static_cast<float>(dn[l / 8]);
}

void tile_portable(const uint8_t* qs, const at::Half* d, bool q4, int64_t kp, int64_t tile, const uint8_t* act,
                   const float* lane_scales, int64_t m, float* acc) {
  const int64_t chunks = kp / CHUNK;
  Prepared p;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t n = 0; n < TILE_N; ++n) {
      prepare_scalar(qs, d, q4, chunks, tile, c, n, p);
      for (int64_t r = 0; r < m; ++r) {
        const uint8_t* av = act + r * kp + c * CHUNK;
        const float* sv = lane_scales + (r * chunks + c) * LANES;
        float* out = row_acc(acc, r, n);
        for (int64_t l = 0; l < LANES; ++l) {
          int32_t t = p.neg_corr[l];
          for (int64_t k = 0; k < 4; ++k) t += static_cast<int32_t>(av[4 * l + k]) * p.w[4 * l + k];
          out[l] = std::fma(static_cast<float>(t), p.d[l] * sv[l], out[l]);
        }
      }
    }
  }
}

#if SSD_BQ_VECTOR
struct Chunk {  // Prepared, in registers
  __m512i w, neg_corr;
  __m512 d;
};

constexpr int64_t PREFETCH_CHUNKS = 8;  // how far ahead of the pass the tile's stream is fetched

inline Chunk chunk_vector(const uint8_t* qs, const at::Half* d, bool q4, int64_t chunks, int64_t tile, int64_t c,
                          int64_t n) {
  Chunk k;
  const uint8_t* src = chunk_values(qs, q4, chunks, tile, c, n);
  _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH_CHUNKS * TILE_N * (q4 ? CHUNK / 2 : CHUNK)), _MM_HINT_T0);
  if (q4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(x, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
    k.w = _mm512_sub_epi8(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(8));
  } else {
    k.w = _mm512_loadu_si512(src);
  }
  const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), k.w);
  k.neg_corr = _mm512_sub_epi32(_mm512_setzero_si512(), sum);
  int32_t pair;
  std::memcpy(&pair, chunk_scales(d, chunks, tile, c, n), sizeof(pair));
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  k.d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(both));
  return k;
}

// sum + float(the chunk's 16 lane sums) x (weight scale x activation scale), lane by lane.
inline __m512 step(const Chunk& k, const __m512i av, const __m512 sv, const __m512 sum) {
  const __m512i t = _mm512_dpbusd_epi32(k.neg_corr, av, k.w);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(k.d, sv), sum);
}

// Few rows (R <= TILE_R): each chunk of the tile's channels is unpacked into registers and used by every row;
// the accumulators stay in registers for the whole input.
template <int R>
void tile_registers(const uint8_t* qs, const at::Half* d, bool q4, int64_t kp, int64_t tile, const uint8_t* act,
                    const float* lane_scales, float* acc) {
  const int64_t chunks = kp / CHUNK;
  __m512 sums[TILE_N][R];
  for (int n = 0; n < TILE_N; ++n)
    for (int r = 0; r < R; ++r) sums[n][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    Chunk k[TILE_N];
    for (int n = 0; n < TILE_N; ++n) k[n] = chunk_vector(qs, d, q4, chunks, tile, c, n);
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_loadu_si512(act + r * kp + c * CHUNK);
      const __m512 sv = _mm512_loadu_ps(lane_scales + (r * chunks + c) * LANES);
      for (int n = 0; n < TILE_N; ++n) sums[n][r] = step(k[n], av, sv, sums[n][r]);
    }
  }
  for (int n = 0; n < TILE_N; ++n)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(row_acc(acc, r, n), sums[n][r]);
}

// Any number of rows: the same, with the accumulators in L1 (measured faster than preparing a segment of
// weights in a buffer and taking the rows four at a time).
void tile_streamed(const uint8_t* qs, const at::Half* d, bool q4, int64_t kp, int64_t tile, const uint8_t* act,
                   const float* lane_scales, int64_t m, float* acc) {
  const int64_t chunks = kp / CHUNK;
  for (int64_t c = 0; c < chunks; ++c) {
    Chunk k[TILE_N];
    for (int n = 0; n < TILE_N; ++n) k[n] = chunk_vector(qs, d, q4, chunks, tile, c, n);
    for (int64_t r = 0; r < m; ++r) {
      const __m512i av = _mm512_loadu_si512(act + r * kp + c * CHUNK);
      const __m512 sv = _mm512_loadu_ps(lane_scales + (r * chunks + c) * LANES);
      for (int n = 0; n < TILE_N; ++n)
        _mm512_storeu_ps(row_acc(acc, r, n), step(k[n], av, sv, _mm512_loadu_ps(row_acc(acc, r, n))));
    }
  }
}

void tile_vector(const uint8_t* qs, const at::Half* d, bool q4, int64_t kp, int64_t tile, const uint8_t* act,
                 const float* lane_scales, int64_t m, float* acc) {
  switch (m) {
    case 1: tile_registers<1>(qs, d, q4, kp, tile, act, lane_scales, acc); break;
    case 2: tile_registers<2>(qs, d, q4, kp, tile, act, lane_scales, acc); break;
    case 3: tile_registers<3>(qs, d, q4, kp, tile, act, lane_scales, acc); break;
    case 4: tile_registers<4>(qs, d, q4, kp, tile, act, lane_scales, acc); break;
    default: tile_streamed(qs, d, q4, kp, tile, act, lane_scales, m, acc); break;
  }
}
#endif

// Row x[0:k] as unsigned int8 (q + 128, zero beyond k) in blocks of 32, and each chunk's 16 lane scales.
void quantize_row(const float* x, int64_t k, int64_t kp, uint8_t* a, float* s) {
  for (int64_t b = 0; b < kp / BLOCK; ++b) {
    const int64_t lo = b * BLOCK;
    float amax = 0.f;
    for (int64_t i = lo; i < std::min(lo + BLOCK, k); ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = lo; i < lo + BLOCK; ++i) {
      const float q = i < k ? std::nearbyint(x[i] * inv) : 0.f;
      a[i] = static_cast<uint8_t>(static_cast<int32_t>(std::max(-127.f, std::min(127.f, q))) + 128);
    }
    float* lane = s + (b / 2) * LANES + (b % 2) * 8;
    for (int64_t j = 0; j < 8; ++j) lane[j] = scale;
  }
}

// Fixed pairwise combination of 16 lanes: lane j += lane j + 8, then j += j + 4, j += j + 2, 0 += 1.
inline float combine(const float* lanes) {
  float v[LANES];
  std::memcpy(v, lanes, sizeof(v));
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) v[j] += v[j + width];
  return v[0];
}

#if SSD_BQ_VECTOR
// The same additions in registers (the scalar loop above goes through memory, a chain of store-to-load
// forwards that cost as much as the product itself for short inputs).
inline float combine_vector(const float* lanes) {
  const __m512 v = _mm512_loadu_ps(lanes);
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

}  // namespace

bool vectorized() { return SSD_BQ_VECTOR != 0; }

// x [m, k] float32; qs [np, kp / 2] uint8 (q4) or [np, kp] int8 (q8) and d [np, kp / 32] float16, both in the
// tile-major order above (shapes as if channel-major), np a multiple of 4 and kp of 64 (padding: zero scales). Returns [m, n_out] float32. portable: take the portable path
// even where the vector one was compiled (tests compare them).
torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, bool q4, int64_t n_out,
                                 bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "block_quant_linear: x must be 2-D float32");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kHalf && d.is_contiguous(),
              "block_quant_linear: scales must be contiguous 2-D float16");
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1, "block_quant_linear: contiguous 8-bit weights");
  const int64_t m = x.size(0), k = x.size(1), np = d.size(0), kp = d.size(1) * BLOCK;
  TORCH_CHECK(np % TILE_N == 0 && kp % CHUNK == 0 && k <= kp && n_out <= np, "block_quant_linear: bad padding");
  TORCH_CHECK(qs.size(0) == np && qs.size(1) == (q4 ? kp / 2 : kp), "block_quant_linear: weights/scales mismatch");
  auto xc = x.contiguous();
  auto out = torch::empty({m, n_out}, x.options());
  if (m == 0 || n_out == 0) return out;
  const int64_t chunks = kp / CHUNK;
  std::vector<uint8_t> act(static_cast<size_t>(m * kp));
  std::vector<float> lane_scales(static_cast<size_t>(m * chunks * LANES));
  const float* x_p = xc.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    quantize_row(x_p + r * k, k, kp, act.data() + r * kp, lane_scales.data() + r * chunks * LANES);
  const uint8_t* qs_p = static_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* d_p = d.data_ptr<at::Half>();
  float* out_p = out.data_ptr<float>();
  const bool use_vector = SSD_BQ_VECTOR && !portable;
  at::parallel_for(0, np / TILE_N, 1, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<float> acc(static_cast<size_t>(m * TILE_N * LANES));
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      std::fill(acc.begin(), acc.end(), 0.f);
#if SSD_BQ_VECTOR
      if (use_vector)
        tile_vector(qs_p, d_p, q4, kp, tile, act.data(), lane_scales.data(), m, acc.data());
      else
#endif
        tile_portable(qs_p, d_p, q4, kp, tile, act.data(), lane_scales.data(), m, acc.data());
      for (int64_t n = 0; n < TILE_N && tile * TILE_N + n < n_out; ++n)
        for (int64_t r = 0; r < m; ++r) {
          const float* lanes = row_acc(acc.data(), r, n);
#if SSD_BQ_VECTOR
          out_p[r * n_out + tile * TILE_N + n] = use_vector ? combine_vector(lanes) : combine(lanes);
#else
          out_p[r * n_out + tile * TILE_N + n] = combine(lanes);
#endif
        }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_quant_linear", &block_quant_linear, "block-quantized product (see block_quant.py)");
  m.def("vectorized", &vectorized, "whether the AVX-512 VNNI path was compiled");
}
