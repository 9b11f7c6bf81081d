// A decoder's layers in one call on CPU (documented in ssd/models/layer_stack.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace ssd {

// One projection over block-quantized weights (block_quant.cpp's layout), plus its bias where it has one.
struct Projection {
  at::Tensor packed;
  int64_t kind;
  int64_t out_features;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const;
};

struct DecoderLayerWeights {
  at::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
  std::optional<at::Tensor> q_norm, k_norm;  // per-head norms of the queries and keys (Qwen3)
};

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
             at::Tensor final_norm);

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, Projection qkv, Projection o,
                 Projection gate_up, Projection down, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The final-normed hidden states [T, hidden] of the embedded tokens h [T, hidden]; every layer writes this
  // step's keys and values into its caches [slots, Hkv, D] at slot_mapping and attends with row_attention.
  // With `capture` (layer indices), also the hidden states entering those layers (the residual stream before
  // each), concatenated in that order [T, n * hidden]: an EAGLE-3 head's features; else an undefined tensor.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, at::Tensor cos, at::Tensor sin,
                                             const std::vector<at::Tensor>& key_caches,
                                             const std::vector<at::Tensor>& value_caches, at::Tensor slot_mapping,
                                             at::Tensor kv_slots, at::Tensor query_rows,
                                             std::optional<at::Tensor> mask,
                                             const std::vector<int64_t>& capture) const;

 private:
  at::Tensor attention(const DecoderLayerWeights& layer, at::Tensor normed, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, const at::Tensor& kv_slots, const at::Tensor& query_rows,
                       const std::optional<at::Tensor>& mask) const;

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  at::Tensor final_norm_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace ssd
