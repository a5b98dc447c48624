// A Llama or Gemma decoder layer on the CPU in one call from Python, and the block linear it is made of.
//
// A one-row decode step of a 30-layer model made about 300 calls from Python into these kernels, each behind an
// nn.Module call, attribute lookups and an argument check: 2.3 ms of an 8.6 ms step on an AMD EPYC Zen 4, more than
// the step's attention, norms and head together. Here a layer's ten kernel calls are made from C++, the same
// functions with the same arguments in the same order as model/llama.py's Python path, so every result has that
// path's bits (tests/model/test_llama_cpu_layer.py).
#include <torch/extension.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// How a part of a block linear multiplies (linear.py's BlockQuantLinear chooses, per part).
enum Multiply : int64_t {
  kFloat32Fma = 0,  // block_panel_linear: the decoded weights by float32 FMAs
  kBf16Dot = 1,     // block_panel_linear_bf16_dot for bfloat16 rows (block_panel_linear for others)
  kInt8 = 2,        // block_panel_linear_int8: the rows quantized to int8 per block of 32
  kBf16Tiles = 3,   // kBf16Dot on AMX tiles
};

// A linear whose weights are blocks laid out in panels (linear.py's BlockWeight.panels), as parts of one format
// each, their outputs side by side.
class PanelLinear {
 public:
  PanelLinear(std::vector<at::Tensor> panels, std::vector<at::Tensor> scales, std::vector<std::string> formats,
              std::vector<int64_t> out_features) {
    TORCH_CHECK(!panels.empty() && panels.size() == scales.size() && panels.size() == formats.size() &&
                    panels.size() == out_features.size(), "one panels, scales, format and width per part");
    for (size_t i = 0; i < panels.size(); ++i)
      parts_.push_back({panels[i], scales[i], formats[i], out_features[i], kFloat32Fma});
  }

  void set_multiply(const std::vector<int64_t>& multiply, bool float_output) {
    TORCH_CHECK(multiply.size() == parts_.size(), "one way to multiply per part");
    for (size_t i = 0; i < parts_.size(); ++i) {
      TORCH_CHECK(multiply[i] >= kFloat32Fma && multiply[i] <= kBf16Tiles,
                  "multiply: 0 (fma), 1 (bf16 dot), 2 (int8) or 3 (bf16 dot on AMX tiles)");
      TORCH_CHECK(multiply[i] != kBf16Tiles || bf16_dot_tiles_available(), "multiply 3: no AMX-BF16 tiles here");
      parts_[i].multiply = multiply[i];
    }
    float_output_ = float_output;
  }

  at::Tensor forward(const at::Tensor& x) const {
    if (parts_.size() == 1) return multiply(parts_[0], x);
    std::vector<at::Tensor> outputs;
    for (const Part& part : parts_) outputs.push_back(multiply(part, x));
    return at::cat(outputs, -1);
  }

 private:
  struct Part {
    at::Tensor panels, scales;
    std::string format;
    int64_t out_features;
    int64_t multiply;
  };

  at::Tensor multiply(const Part& p, const at::Tensor& x) const {
    if (p.multiply == kInt8)
      return block_panel_linear_int8(x, p.panels, p.scales, p.format, p.out_features, float_output_, "auto");
    if ((p.multiply == kBf16Dot || p.multiply == kBf16Tiles) && x.scalar_type() == at::kBFloat16)
      return block_panel_linear_bf16_dot(x, p.panels, p.scales, p.format, p.out_features, float_output_,
                                         p.multiply == kBf16Tiles);
    return block_panel_linear(x, p.panels, p.scales, p.format, p.out_features, float_output_);
  }

  std::vector<Part> parts_;
  bool float_output_ = false;
};

// 8-bit cache rows (--kv-cache-dtype int8 / fp8_*): layers/attention/kv_rows.py's is_quantized.
bool quantized_rows(const at::Tensor& cache) {
  const auto dtype = cache.scalar_type();
  return dtype == at::kChar || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}

// layers/attention/cpu_kernel.py's write_kv: the step's keys and values [T, KVH, D] into this layer's cache rows.
void write_kv_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  if (quantized_rows(k_cache)) {
    quantize_kv_(k.contiguous(), k_cache, slot_mapping);
    quantize_kv_(v.contiguous(), v_cache, slot_mapping);
  } else {
    write_kv_(k_cache, v_cache, k, v, slot_mapping);
  }
}

// model/llama.py's LlamaDecoderLayer without q/k/v biases, q/k norms or experts, its linears PanelLinears, its
// attention layers/attention/cpu_kernel.py's.
class LlamaLayer {
 public:
  LlamaLayer(at::Tensor input_norm, at::Tensor post_attention_norm, double eps, std::shared_ptr<PanelLinear> qkv,
             std::shared_ptr<PanelLinear> o, std::shared_ptr<PanelLinear> gate_up, std::shared_ptr<PanelLinear> down,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, int64_t window)
      : input_norm_(std::move(input_norm)), post_attention_norm_(std::move(post_attention_norm)), eps_(eps),
        qkv_(std::move(qkv)), o_(std::move(o)), gate_up_(std::move(gate_up)), down_(std::move(down)),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), window_(window) {}

  // (this layer's MLP output, the residual stream before it is added), as LlamaDecoderLayer.forward returns them.
  // x [T, hidden] contiguous; the rest is the step's: RoPE's positions and float32 tables, this layer's caches, and
  // the attention metadata (CpuKernelMetadata).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                             const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& token_table, const at::Tensor& context_lens) const {
    const int64_t tokens = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    auto [h, stream] = add_rms_norm(x, residual, input_norm_, eps_);
    const at::Tensor qkv = qkv_->forward(h);
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads_ + num_kv_heads_, head_dim_});
    rotary_embedding_(qk, positions, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, num_heads_), k = qk.narrow(1, num_heads_, num_kv_heads_);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    write_kv_rows(k_cache, v_cache, k, v, slot_mapping);
    const at::Tensor heads = paged_attention(q.contiguous(), k_cache, v_cache, block_tables, token_table, context_lens,
                                             scale_, window_, 0.0);
    auto [normed, stream_out] = add_rms_norm(o_->forward(heads.view({tokens, q_size})), stream, post_attention_norm_,
                                             eps_);
    return {down_->forward(silu_and_mul_v16(gate_up_->forward(normed))), stream_out};
  }

 private:
  at::Tensor input_norm_, post_attention_norm_;
  double eps_;
  std::shared_ptr<PanelLinear> qkv_, o_, gate_up_, down_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  int64_t window_;
};

// A model's LlamaLayers in turn in one call from Python: model/llama.py's loop over its layers, the same calls in the
// same order (so the same bits: tests/model/test_llama_cpu_layer.py). From Python, each layer cost a module call and
// its arguments' conversions, about 10 microseconds: 0.3 ms of the embedded 30-layer model's 7 ms decode step
// (benchmarks/README.md, "The layers in one call").
class LlamaLayers {
 public:
  explicit LlamaLayers(std::vector<std::shared_ptr<LlamaLayer>> layers) : layers_(std::move(layers)) {
    TORCH_CHECK(!layers_.empty(), "LlamaLayers: no layers");
  }

  // (the last layer's MLP output, the residual stream before it is added) for the model's input x [T, hidden];
  // kv_caches [layers, 2, ...] (kv_rows.py's new_kv_cache), the rest as LlamaLayer::forward takes them.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                                             const at::Tensor& sin, const at::Tensor& kv_caches,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& token_table, const at::Tensor& context_lens) const {
    TORCH_CHECK(kv_caches.size(0) == static_cast<int64_t>(layers_.size()), "LlamaLayers: ", layers_.size(),
                " layers but caches for ", kv_caches.size(0));
    std::tuple<at::Tensor, at::Tensor> out;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor cache = kv_caches.select(0, static_cast<int64_t>(i));
      out = i == 0 ? layers_[i]->forward(x, c10::nullopt, positions, cos, sin, cache.select(0, 0), cache.select(0, 1),
                                         slot_mapping, block_tables, token_table, context_lens)
                   : layers_[i]->forward(std::get<0>(out), std::get<1>(out), positions, cos, sin, cache.select(0, 0),
                                         cache.select(0, 1), slot_mapping, block_tables, token_table, context_lens);
    }
    return out;
  }

 private:
  std::vector<std::shared_ptr<LlamaLayer>> layers_;
};

// model/gemma3.py's Gemma3DecoderLayer, its linears PanelLinears, its norms and GeGLU the C++ passes of
// fused_ops.cpp with the vector widths (lanes) that give the PyTorch lines' bits (layers/norm.py exact_sum_lanes,
// layers/activation.py exact_gelu_lanes), its attention layers/attention/cpu_kernel.py's.
class GemmaLayer {
 public:
  GemmaLayer(std::shared_ptr<PanelLinear> qkv, std::shared_ptr<PanelLinear> o, std::shared_ptr<PanelLinear> gate_up,
             std::shared_ptr<PanelLinear> down, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
             at::Tensor post_attention_norm, at::Tensor pre_feedforward_norm, at::Tensor post_feedforward_norm,
             double eps, int64_t head_lanes, int64_t hidden_lanes, int64_t gelu_lanes, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double scale, int64_t window, double softcap)
      : qkv_(std::move(qkv)), o_(std::move(o)), gate_up_(std::move(gate_up)), down_(std::move(down)),
        q_norm_(std::move(q_norm)), k_norm_(std::move(k_norm)), post_attention_norm_(std::move(post_attention_norm)),
        pre_feedforward_norm_(std::move(pre_feedforward_norm)),
        post_feedforward_norm_(std::move(post_feedforward_norm)), eps_(eps), head_lanes_(head_lanes),
        hidden_lanes_(hidden_lanes), gelu_lanes_(gelu_lanes), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), scale_(scale), window_(window), softcap_(softcap) {}

  // (next_norm(r), r) for the new residual stream r, as Gemma3DecoderLayer.forward returns them; x is this layer's
  // input, normed by the layer before.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& next_norm, const at::Tensor& positions,
                                             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables, const at::Tensor& token_table,
                                             const at::Tensor& context_lens) const {
    const int64_t tokens = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const at::Tensor qkv = qkv_->forward(x);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    if (q_norm_.has_value()) {
      q = std::get<0>(gemma_rms_norm(q, *q_norm_, eps_, head_lanes_, c10::nullopt, c10::nullopt));
      k = std::get<0>(gemma_rms_norm(k, *k_norm_, eps_, head_lanes_, c10::nullopt, c10::nullopt));
    }
    rotary_embedding_(q, positions, cos, sin);
    rotary_embedding_(k, positions, cos, sin);
    write_kv_rows(k_cache, v_cache, k, v, slot_mapping);
    const at::Tensor heads = paged_attention(q.contiguous(), k_cache, v_cache, block_tables, token_table, context_lens,
                                             scale_, window_, softcap_);
    auto [h, stream] = gemma_rms_norm(o_->forward(heads.view({tokens, q_size})), post_attention_norm_, eps_,
                                      hidden_lanes_, residual, pre_feedforward_norm_);
    const at::Tensor mlp = down_->forward(gelu_tanh_and_mul(gate_up_->forward(h), gelu_lanes_));
    return gemma_rms_norm(mlp, post_feedforward_norm_, eps_, hidden_lanes_, stream, next_norm);
  }

 private:
  std::shared_ptr<PanelLinear> qkv_, o_, gate_up_, down_;
  c10::optional<at::Tensor> q_norm_, k_norm_;
  at::Tensor post_attention_norm_, pre_feedforward_norm_, post_feedforward_norm_;
  double eps_;
  int64_t head_lanes_, hidden_lanes_, gelu_lanes_, num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  int64_t window_;
  double softcap_;
};

// A model's GemmaLayers in turn in one call from Python, as LlamaLayers: model/gemma3.py's loop, each layer on its
// own RoPE tables (sliding layers the local ones) and normed by the next layer's input norm (the last by the
// model's final norm).
class GemmaLayers {
 public:
  GemmaLayers(std::vector<std::shared_ptr<GemmaLayer>> layers, std::vector<at::Tensor> next_norms,
              std::vector<bool> local)
      : layers_(std::move(layers)), next_norms_(std::move(next_norms)), local_(std::move(local)) {
    TORCH_CHECK(!layers_.empty() && next_norms_.size() == layers_.size() && local_.size() == layers_.size(),
                "GemmaLayers: one next norm and one RoPE choice per layer");
  }

  // (the final norm of the residual stream, that stream) for the first layer's input x (normed) and residual.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& positions, const at::Tensor& global_cos,
                                             const at::Tensor& global_sin, const at::Tensor& local_cos,
                                             const at::Tensor& local_sin, const at::Tensor& kv_caches,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& token_table, const at::Tensor& context_lens) const {
    TORCH_CHECK(kv_caches.size(0) == static_cast<int64_t>(layers_.size()), "GemmaLayers: ", layers_.size(),
                " layers but caches for ", kv_caches.size(0));
    std::tuple<at::Tensor, at::Tensor> out{x, residual};
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor cache = kv_caches.select(0, static_cast<int64_t>(i));
      out = layers_[i]->forward(std::get<0>(out), std::get<1>(out), next_norms_[i], positions,
                                local_[i] ? local_cos : global_cos, local_[i] ? local_sin : global_sin,
                                cache.select(0, 0), cache.select(0, 1), slot_mapping, block_tables, token_table,
                                context_lens);
    }
    return out;
  }

 private:
  std::vector<std::shared_ptr<GemmaLayer>> layers_;
  std::vector<at::Tensor> next_norms_;
  std::vector<bool> local_;
};

}  // namespace

void bind_decoder_layers(pybind11::module_& m) {
  namespace py = pybind11;
  using no_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<PanelLinear, std::shared_ptr<PanelLinear>>(m, "PanelLinear",
                                                        "a block linear's parts (panels, scales, format, width)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::string>,
                    std::vector<int64_t>>(),
           py::arg("panels"), py::arg("scales"), py::arg("formats"), py::arg("out_features"))
      .def("set_multiply", &PanelLinear::set_multiply,
           "per part 0 (float32 FMAs), 1 (bfloat16 dot products for bfloat16 rows), 2 (int8 activations) or 3 (1 on "
           "AMX tiles); and whether the result is float32",
           py::arg("multiply"), py::arg("float_output"))
      .def("__call__", &PanelLinear::forward, "x W^T", no_gil());
  py::class_<LlamaLayer, std::shared_ptr<LlamaLayer>>(m, "LlamaLayer", "a Llama decoder layer's kernel calls in one")
      .def(py::init<at::Tensor, at::Tensor, double, std::shared_ptr<PanelLinear>, std::shared_ptr<PanelLinear>,
                    std::shared_ptr<PanelLinear>, std::shared_ptr<PanelLinear>, int64_t, int64_t, int64_t, double,
                    int64_t>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("window"))
      .def("__call__", &LlamaLayer::forward, "(the MLP output, the residual stream before it)", no_gil());
  py::class_<LlamaLayers>(m, "LlamaLayers", "a model's LlamaLayers in turn in one call")
      .def(py::init<std::vector<std::shared_ptr<LlamaLayer>>>(), py::arg("layers"))
      .def("__call__", &LlamaLayers::forward, "(the last layer's MLP output, the residual stream before it)", no_gil());
  py::class_<GemmaLayer, std::shared_ptr<GemmaLayer>>(m, "GemmaLayer",
                                                      "a Gemma 2 / 3 decoder layer's kernel calls in one")
      .def(py::init<std::shared_ptr<PanelLinear>, std::shared_ptr<PanelLinear>, std::shared_ptr<PanelLinear>,
                    std::shared_ptr<PanelLinear>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, at::Tensor,
                    at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    int64_t, double>(),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("post_attention_norm"), py::arg("pre_feedforward_norm"), py::arg("post_feedforward_norm"),
           py::arg("eps"), py::arg("head_lanes"), py::arg("hidden_lanes"), py::arg("gelu_lanes"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("window"), py::arg("softcap"))
      .def("__call__", &GemmaLayer::forward, "(next_norm(r), r) for the new residual stream r", no_gil());
  py::class_<GemmaLayers>(m, "GemmaLayers", "a model's GemmaLayers in turn in one call")
      .def(py::init<std::vector<std::shared_ptr<GemmaLayer>>, std::vector<at::Tensor>, std::vector<bool>>(),
           py::arg("layers"), py::arg("next_norms"), py::arg("local"))
      .def("__call__", &GemmaLayers::forward, "(the final norm of the residual stream, that stream)", no_gil());
}
