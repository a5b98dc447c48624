// The Python module of the CPU kernels: one binding per kernel file in this folder.
#include <torch/extension.h>

#include <string>
#include <tuple>

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& token_table,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap);
void quantize_kv_(const at::Tensor& x, at::Tensor cache, const at::Tensor& slot_mapping);
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                              const std::string& format, int64_t out_features, bool float_output);
bool block_panel_kernel_available();
at::Tensor dense_panel_linear(const at::Tensor& x, const at::Tensor& weight_t, bool float_output);
at::Tensor block_panel_linear_int8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                   const std::string& format, int64_t out_features, bool float_output,
                                   const std::string& kernel);
bool block_int8_kernel_available();
at::Tensor block_panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                       const std::string& format, int64_t out_features, bool float_output);
bool block_bf16_dot_kernel_available();
bool block_int8_amx_available();
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                  int64_t lanes, const c10::optional<at::Tensor>& residual,
                                                  const c10::optional<at::Tensor>& next_weight);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x, int64_t lanes);
at::Tensor argmax_rows(const at::Tensor& x);
void rotary_embedding_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul_v16(const at::Tensor& x);
at::Tensor moe_expert_slots(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up_t, const at::Tensor& down_t, int64_t first_expert);
at::Tensor moe_sum_slots(const at::Tensor& slots, const at::Tensor& like);

// Every kernel lets go of the GIL while it runs, as PyTorch's own ops do: the server's event loop thread keeps
// serving HTTP while the engine thread is inside a kernel.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "attention of each query token over its prefix in the paged KV cache",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("token_table"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, no_gil());
  m.def("write_kv_", &write_kv_, "writes each token's keys and values into the float cache rows", no_gil());
  m.def("quantize_kv_", &quantize_kv_, "writes keys or values into 8-bit cache rows with a scale each", no_gil());
  m.def("add_rms_norm", &add_rms_norm, "weight * rms_norm(x + residual) and x + residual, in one pass", no_gil());
  m.def("rotary_embedding_", &rotary_embedding_, "rotate-half RoPE in place, by position", no_gil());
  m.def("silu_and_mul_v16", &silu_and_mul_v16, "silu_and_mul, bfloat16 16 lanes at a time (the same bits)", no_gil());
  m.def("block_panel_linear", &block_panel_linear, "x W^T with W in 16-column panels of blocks (q4, q8)", no_gil());
  m.def("block_panel_kernel_available", &block_panel_kernel_available, "whether block_panel_linear was compiled");
  m.def("dense_panel_linear", &dense_panel_linear, "x W^T with W bfloat16 or float32, given as W^T [K, N]", no_gil());
  m.def("block_panel_linear_int8", &block_panel_linear_int8,
        "block_panel_linear with the activations quantized to int8 per block (integer dot products)", py::arg("x"),
        py::arg("panels"), py::arg("scales"), py::arg("format"), py::arg("out_features"), py::arg("float_output"),
        py::arg("kernel") = "auto", no_gil());
  m.def("block_int8_kernel_available", &block_int8_kernel_available, "whether block_panel_linear_int8 was compiled");
  m.def("block_panel_linear_bf16_dot", &block_panel_linear_bf16_dot,
        "block_panel_linear for bfloat16 x on q4, q4k and q8 blocks with bfloat16 dot products on the codes", no_gil());
  m.def("block_bf16_dot_kernel_available", &block_bf16_dot_kernel_available,
        "whether block_panel_linear_bf16_dot was compiled (AVX-512 BF16)");
  m.def("block_int8_amx_available", &block_int8_amx_available,
        "whether block_panel_linear_int8 can run on AMX tiles here (compiled, and the CPU and OS allow them)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]", no_gil());
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's x / rms(x) * (1 + w), optionally added to a residual and normed again",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("lanes"), py::arg("residual") = py::none(),
        py::arg("next_weight") = py::none(), no_gil());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for x = [gate | up]", no_gil());
  m.def("moe_expert_slots", &moe_expert_slots, "a MoE layer's experts over their routed rows, weighted, per slot",
        no_gil());
  m.def("moe_sum_slots", &moe_sum_slots, "a MoE layer's k slots a token summed in slot order, in x's dtype", no_gil());
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value (float32)", no_gil());
}
