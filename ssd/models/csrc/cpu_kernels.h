// The CPU kernels of one extension (``ssd/models/native.py`` builds every source of this folder into one
// module): what each source offers the others and bindings.cpp. Each function is documented at its definition
// and in the Python module that calls it (block_quant.py, cpu_fused.py, row_attention.py, layer_stack.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace ssd {

// block_quant.cpp: y = x @ W.T over weights in GGUF-style blocks.
at::Tensor block_quant_linear(at::Tensor x, at::Tensor packed, int64_t kind_code, int64_t n_out, bool portable);
bool block_quant_vectorized();

// cpu_fused.cpp: a decoder layer's glue.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                                at::Tensor weight, double eps);
void rope_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);

// row_attention.cpp: attention computed for every query row on its own.
at::Tensor row_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor kv_slots,
                         at::Tensor query_rows, std::optional<at::Tensor> mask, double scale);

}  // namespace ssd
