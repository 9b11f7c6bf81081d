// The per-layer glue of a decoder step on CPU in one call each, for float32 models: the residual add with the
// RMSNorm after it, and RoPE with the K/V cache write. In PyTorch ops these are ~30 small operators per layer
// (each a few microseconds of dispatch for a few hundred floats): at the 135M model's 30 layers ~3 ms of a 13.6 ms
// q8_0 decode step, about half of what streaming its quantized weights takes. Documented in cpu_fused.py.
//
// Every row is computed alone, in a fixed order, so a row's result does not depend on the rows beside it or on
// the thread count (batch invariance). RoPE rounds exactly as PyTorch's elementwise ops do (products rounded,
// then the sum; the build never contracts them into a fused multiply-add), so its results equal the unfused
// path's bit for bit; the norm's sum of squares runs in its own fixed order (16 lanes, combined pairwise).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t ROWS_PER_TASK = 16;  // rows a thread takes at a time (a row is a few hundred floats)

// Sum of squares of x[0:n] in a fixed order: 16 running sums (one vector register), combined pairwise, then the
// tail.
float sum_of_squares(const float* x, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t j = 0; j < LANES; ++j) acc[j] += x[i + j] * x[i + j];
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  float total = acc[0];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

}  // namespace

namespace ssd {

// h = x + residual (x alone where residual is undefined); returns (weight * (h * rsqrt(mean(h^2) + eps)), h).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                                at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "add_rms_norm: x must be 2-D float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat,
              "add_rms_norm: weight must be float32 of x's width");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const bool add = residual.has_value() && residual->defined();
  at::Tensor h = xc;
  if (add) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "add_rms_norm: residual must match x");
    h = at::empty_like(xc);
  }
  auto rc = add ? residual->contiguous() : xc;
  auto out = at::empty_like(xc);
  const float* x_p = xc.data_ptr<float>();
  const float* r_p = rc.data_ptr<float>();
  const float* w_p = wc.data_ptr<float>();
  float* h_p = h.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x_p + r * cols;
      float* hr = h_p + r * cols;
      if (add) {
        const float* rr = r_p + r * cols;
        for (int64_t i = 0; i < cols; ++i) hr[i] = xr[i] + rr[i];
      }
      const float inv = 1.f / std::sqrt(sum_of_squares(hr, cols) / static_cast<float>(cols) + epsilon);
      float* orow = o_p + r * cols;
      for (int64_t i = 0; i < cols; ++i) orow[i] = w_p[i] * (hr[i] * inv);
    }
  });
  return {out, h};
}

// Rotate the q heads of qkv [T, (H + 2 Hkv) D] in place (rotate-half RoPE by cos, sin [T, D/2]) and write the
// rotated k heads and the v heads to slot slot_mapping[t] of the caches [slots, Hkv, D].
void rope_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "rope_write_kv: qkv must be 2-D float32 with contiguous rows");
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rope_write_kv: qkv's width does not match the heads");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.scalar_type() == at::kFloat && value_cache.scalar_type() == at::kFloat,
              "rope_write_kv: the caches must be contiguous float32");
  const int64_t tokens = qkv.size(0), half = head_dim / 2, row_stride = qkv.stride(0);
  auto cc = cos.contiguous(), sc = sin.contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(cc.numel() == tokens * half && sc.numel() == tokens * half && slots.numel() == tokens,
              "rope_write_kv: cos, sin and slot_mapping must have one row per token");
  const int64_t cache_slots = key_cache.numel() / (num_kv_heads * head_dim);
  float* q_p = qkv.data_ptr<float>();
  const float* c_p = cc.data_ptr<float>();
  const float* s_p = sc.data_ptr<float>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  float* k_p = key_cache.data_ptr<float>();
  float* v_p = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < cache_slots, "rope_write_kv: slot ", slot_p[t], " out of range");
  at::parallel_for(0, tokens, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = q_p + t * row_stride;
      const float* c = c_p + t * half;
      const float* s = s_p + t * half;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = row + h * head_dim;
        float* dest = h < num_heads ? x : k_p + (slot_p[t] * num_kv_heads + h - num_heads) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          const float a = x1 * c[i] - x2 * s[i];
          const float b = x2 * c[i] + x1 * s[i];
          dest[i] = a;
          dest[half + i] = b;
        }
      }
      const float* v = row + (num_heads + num_kv_heads) * head_dim;
      std::memcpy(v_p + slot_p[t] * num_kv_heads * head_dim, v, sizeof(float) * num_kv_heads * head_dim);
    }
  });
}

}  // namespace ssd
