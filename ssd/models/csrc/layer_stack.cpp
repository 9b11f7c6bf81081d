// A decoder's layers in one call on CPU: the operations of DecoderLayer.fused_forward with the C++ kernels of
// cpu_fused.cpp, block_quant.cpp and row_attention.cpp, in the same order on the same tensors, so the result is
// the Python path's bit for bit, without its ~25 Python-level calls per layer. Documented in layer_stack.py.
#include "layer_stack.h"

#include "cpu_kernels.h"

#include <utility>

namespace ssd {

at::Tensor Projection::operator()(const at::Tensor& x) const {
  at::Tensor out = block_quant_linear(x, packed, kind, out_features, /*portable=*/false);
  return bias.has_value() ? out + *bias : out;
}

LayerStack::LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                       at::Tensor final_norm)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
      final_norm_(std::move(final_norm)) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
              "LayerStack: heads must be positive, query heads a multiple of KV heads, head size even");
}

void LayerStack::add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, Projection qkv, Projection o,
                           Projection gate_up, Projection down, std::optional<at::Tensor> q_norm,
                           std::optional<at::Tensor> k_norm) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "LayerStack: query and key norms come together");
  TORCH_CHECK(qkv.out_features == (num_heads_ + 2 * num_kv_heads_) * head_dim_ && gate_up.out_features % 2 == 0,
              "LayerStack: the projections do not match the heads");
  layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv), std::move(o),
                     std::move(gate_up), std::move(down), std::move(q_norm), std::move(k_norm)});
}

at::Tensor LayerStack::attention(const DecoderLayerWeights& layer, at::Tensor normed, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                                 const at::Tensor& query_rows, const std::optional<at::Tensor>& mask) const {
  const int64_t tokens = normed.size(0), d = head_dim_;
  const int64_t q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
  at::Tensor qkv = layer.qkv(normed);  // [T, (H + 2 Hkv) D]
  if (layer.q_norm.has_value()) {  // per-head norms before RoPE (Qwen3)
    at::Tensor q = std::get<0>(add_rms_norm(qkv.narrow(1, 0, q_size).reshape({-1, d}), std::nullopt,
                                            *layer.q_norm, eps_));
    at::Tensor k = std::get<0>(add_rms_norm(qkv.narrow(1, q_size, kv_size).reshape({-1, d}), std::nullopt,
                                            *layer.k_norm, eps_));
    qkv = at::cat({q.view({tokens, q_size}), k.view({tokens, kv_size}), qkv.narrow(1, q_size + kv_size, kv_size)},
                  -1);
  }
  rope_write_kv(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads_, num_kv_heads_, d);
  at::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, d}).contiguous();  // [T, H, D]
  at::Tensor out = row_attention(query, key_cache.view({-1, num_kv_heads_, d}),
                                 value_cache.view({-1, num_kv_heads_, d}), kv_slots, query_rows, mask,
                                 scale_);  // [T, H, D]
  return layer.o(out.reshape({tokens, q_size}));  // [T, hidden]
}

std::tuple<at::Tensor, at::Tensor> LayerStack::forward(at::Tensor h, at::Tensor cos, at::Tensor sin,
                                                       const std::vector<at::Tensor>& key_caches,
                                                       const std::vector<at::Tensor>& value_caches,
                                                       at::Tensor slot_mapping, at::Tensor kv_slots,
                                                       at::Tensor query_rows, std::optional<at::Tensor> mask,
                                                       const std::vector<int64_t>& capture) const {
  TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
              "LayerStack: expected ", layers_.size(), " key and value caches, got ", key_caches.size(), " and ",
              value_caches.size());
  for (int64_t i : capture) {
    TORCH_CHECK(i >= 0 && i < num_layers(), "LayerStack: feature layer ", i, " is not in [0, ", num_layers(), ")");
  }
  std::vector<at::Tensor> captured(capture.size());
  std::optional<at::Tensor> residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    for (size_t c = 0; c < capture.size(); ++c) {  // the residual stream entering layer i, as the Python layers
      if (capture[c] == static_cast<int64_t>(i)) captured[c] = residual ? h + *residual : h.clone();
    }
    auto [normed, summed] = add_rms_norm(h, residual, layer.input_norm, eps_);
    at::Tensor attn = attention(layer, normed, cos, sin, key_caches[i], value_caches[i], slot_mapping, kv_slots,
                                query_rows, mask);
    std::tie(normed, summed) = add_rms_norm(attn, summed, layer.post_attention_norm, eps_);
    std::vector<at::Tensor> gate_up = layer.gate_up(normed).chunk(2, -1);  // [T, I] each
    h = layer.down(at::silu(gate_up[0]).mul_(gate_up[1]));  // [T, hidden]
    residual = summed;
  }
  at::Tensor out = std::get<0>(add_rms_norm(h, residual, final_norm_, eps_));
  return {out, captured.empty() ? at::Tensor() : at::cat(captured, -1)};
}

}  // namespace ssd
