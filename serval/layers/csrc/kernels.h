// The kernels every file of this folder exports, declared once: bindings.cpp binds them to Python, and the files
// that call each other's (decoder_layers.cpp, moe_experts.cpp, bf16_rows.cpp) include this.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& token_table,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap);
void quantize_kv_(const at::Tensor& x, at::Tensor cache, const at::Tensor& slot_mapping);
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);
// panel_linear.cpp
at::Tensor block_panel_rows(const at::Tensor& panels, const at::Tensor& scales, const std::string& format,
                            const at::Tensor& rows, int64_t in_features);
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                              const std::string& format, int64_t out_features, bool float_output);
bool block_panel_kernel_available();
at::Tensor dense_panel_linear(const at::Tensor& x, const at::Tensor& weight_t, bool float_output);
// int8_linear.cpp
at::Tensor block_panel_linear_int8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                   const std::string& format, int64_t out_features, bool float_output,
                                   const std::string& kernel);
bool block_int8_kernel_available();
bool block_int8_amx_available();
// bf16_dot_linear.cpp
at::Tensor block_panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                       const std::string& format, int64_t out_features, bool float_output,
                                       bool tiles);
bool block_bf16_dot_kernel_available();
bool bf16_dot_is_two_fmas();
void set_bf16_dot_fma_rows(int64_t rows);
bool bf16_dot_tiles_available();
// fused_ops.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                  int64_t lanes, const c10::optional<at::Tensor>& residual,
                                                  const c10::optional<at::Tensor>& next_weight);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x, int64_t lanes);
at::Tensor argmax_rows(const at::Tensor& x);
void rotary_embedding_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
// bf16_rows.cpp
at::Tensor silu_and_mul_v16(const at::Tensor& x);
// moe_experts.cpp
at::Tensor moe_expert_slots(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up_t, const at::Tensor& down_t, int64_t first_expert);
at::Tensor moe_sum_slots(const at::Tensor& slots, const at::Tensor& like);
// block_repack.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_k_blocks(const at::Tensor& raw, const std::string& qtype);
void gguf_k_panels_(const at::Tensor& raw, const std::string& qtype, const c10::optional<at::Tensor>& rows,
                    at::Tensor panels, at::Tensor panel_scales);
void block_panels_(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& super_scales,
                   const std::string& format, at::Tensor panels, at::Tensor panel_scales);
// decoder_layers.cpp: its classes' bindings
void bind_decoder_layers(pybind11::module_& m);
