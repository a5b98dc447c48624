// The Python module of the CPU kernels: one binding per kernel file in this folder.
#include "kernels.h"

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
  m.def("block_panel_rows", &block_panel_rows, "rows of a weight in panels, dequantized to float32", no_gil());
  m.def("block_panel_kernel_available", &block_panel_kernel_available, "whether block_panel_linear was compiled");
  m.def("dense_panel_linear", &dense_panel_linear, "x W^T with W bfloat16 or float32, given as W^T [K, N]", no_gil());
  m.def("block_panel_linear_int8", &block_panel_linear_int8,
        "block_panel_linear with the activations quantized to int8 per block (integer dot products)", py::arg("x"),
        py::arg("panels"), py::arg("scales"), py::arg("format"), py::arg("out_features"), py::arg("float_output"),
        py::arg("kernel") = "auto", no_gil());
  m.def("block_int8_kernel_available", &block_int8_kernel_available, "whether block_panel_linear_int8 was compiled");
  m.def("block_panel_linear_bf16_dot", &block_panel_linear_bf16_dot,
        "block_panel_linear for bfloat16 x on q4, q4k, q6k and q8 blocks with bfloat16 dot products on the codes "
        "(with tiles, on AMX tiles)", py::arg("x"), py::arg("panels"), py::arg("scales"), py::arg("format"),
        py::arg("out_features"), py::arg("float_output"), py::arg("tiles") = false, no_gil());
  m.def("block_bf16_dot_kernel_available", &block_bf16_dot_kernel_available,
        "whether block_panel_linear_bf16_dot was compiled (AVX-512 BF16)");
  m.def("bf16_dot_is_two_fmas", &bf16_dot_is_two_fmas,
        "whether this CPU's vdpbf16ps is two FMAs in turn (its bits by block_panel_linear_bf16_dot's FMA path)");
  m.def("set_bf16_dot_fma_rows", &set_bf16_dot_fma_rows,
        "from how many rows block_panel_linear_bf16_dot takes its FMA path (0: never)", py::arg("rows"));
  m.def("bf16_dot_tiles_available", &bf16_dot_tiles_available,
        "whether block_panel_linear_bf16_dot can run on AMX tiles here (AMX-BF16, granted by the OS)");
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
  m.def("gguf_k_blocks", &gguf_k_blocks, "a GGUF file's Q4_K, Q5_K or Q6_K blocks as (packed, scales, super_scales)",
        no_gil());
  m.def("gguf_k_panels_", &gguf_k_panels_,
        "a GGUF file's Q4_K, Q5_K or Q6_K blocks [N, S, bytes] written as panels of 16 columns, rows in an order",
        py::arg("raw"), py::arg("qtype"), py::arg("rows"), py::arg("panels"), py::arg("panel_scales"), no_gil());
  m.def("block_panels_", &block_panels_, "blocks [N, G, bytes] written as panels of 16 columns", no_gil());
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value (float32)", no_gil());
  bind_decoder_layers(m);
}
