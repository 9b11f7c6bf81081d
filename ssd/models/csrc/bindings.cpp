// The Python module of the CPU kernels: every source of this folder is built into it (ssd/models/native.py).
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "layer_stack.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_quant_linear", &ssd::block_quant_linear, "block-quantized product (see block_quant.py)");
  m.def("block_quant_vectorized", &ssd::block_quant_vectorized, "whether the AVX-512 VNNI path was compiled");
  m.def("add_rms_norm", &ssd::add_rms_norm, "residual add and RMSNorm (see cpu_fused.py)");
  m.def("rope_write_kv", &ssd::rope_write_kv, "RoPE and the K/V cache write (see cpu_fused.py)");
  m.def("row_attention", &ssd::row_attention, "row-invariant paged attention (see row_attention.py)");
  py::class_<ssd::Projection>(m, "Projection")
      .def(py::init<at::Tensor, int64_t, int64_t, std::optional<at::Tensor>>(), py::arg("packed"), py::arg("kind"),
           py::arg("out_features"), py::arg("bias"));
  py::class_<ssd::LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"), py::arg("final_norm"))
      .def("add_layer", &ssd::LayerStack::add_layer)
      .def_property_readonly("num_layers", &ssd::LayerStack::num_layers)
      .def("forward", &ssd::LayerStack::forward, py::call_guard<py::gil_scoped_release>(),
           "the final-normed hidden states of a step and the features of the capture layers (see layer_stack.py)");
}
