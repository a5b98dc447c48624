// The Python module of the CPU kernels: one binding per kernel file in this folder.
#include <torch/extension.h>

#include <string>

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& token_table,
                           const at::Tensor& context_lens, double scale);
at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const std::string& format);
at::Tensor block_quant_linear_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                        const std::string& format);
std::string block_quant_kernel();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of each query token over its prefix in the paged KV cache");
  m.def("block_quant_linear", &block_quant_linear, "x W^T with W in GGUF-style blocks of 32 (q4, q8)");
  m.def("block_quant_linear_reference", &block_quant_linear_reference, "the portable path of block_quant_linear");
  m.def("block_quant_kernel", &block_quant_kernel, "which path block_quant_linear was compiled with");
}
