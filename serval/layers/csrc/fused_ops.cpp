// Small per-token ops fused into one pass each, for the decode step where every aten call's fixed cost adds up
// (61 norms and 30 rotations per step for a 30-layer model). Each reproduces the PyTorch path's roundings: results
// are float32 inside and rounded to the tensor's dtype exactly where the PyTorch code rounds. Rows are computed
// independently and in a fixed order, so a row's result never depends on the others in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                       int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * n;
      for (int64_t i = 0; i < n; ++i) {
        // The residual stream in the model's dtype: x + residual rounded, as the PyTorch add does.
        r[i] = residual ? round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(residual[row * n + i]))
                        : static_cast<float>(xr[i]);
        if (residual_out) residual_out[row * n + i] = static_cast<T>(r[i]);
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += r[i + l] * r[i + l];
      for (; i < n; ++i) lanes[0] += r[i] * r[i];
      float sum = 0.f;
      for (float v : lanes) sum += v;
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t k = 0; k < n; ++k)  // normalised, rounded to the dtype, then scaled (the reference's order)
        out[row * n + k] = static_cast<T>(static_cast<float>(weight[k]) * round_to<T>(r[k] * inv));
    }
  });
}

template <typename T>
void rotate_rows(T* x, int64_t token_stride, const int64_t* positions, const float* cos, const float* sin,
                 int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * dim;
      const float* s = sin + positions[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(v[d]);
        for (int64_t d = 0; d < dim; ++d) {
          // x * cos + rotate_half(x) * sin, with cos and sin in the dtype and each product rounded, as PyTorch.
          const float rotated = d < half ? -row[d + half] : row[d - half];
          const float a = round_to<T>(row[d] * round_to<T>(c[d]));
          const float b = round_to<T>(rotated * round_to<T>(s[d]));
          v[d] = static_cast<T>(a + b);
        }
      }
    }
  });
}

}  // namespace

// x [rows, n]; residual [rows, n] or undefined; weight [n]. Returns (weight * rms_norm(x + residual), x + residual);
// without a residual the second is x itself.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "contiguous x and weight of one dtype");
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(!has_residual || (residual->is_contiguous() && residual->sizes() == x.sizes() &&
                                residual->scalar_type() == x.scalar_type()), "residual like x");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor out = at::empty_like(x);
  at::Tensor residual_out = has_residual ? at::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), has_residual ? residual->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                has_residual ? residual_out.data_ptr<scalar_t>() : nullptr, rows, n,
                                static_cast<float>(eps));
  });
  return {out, residual_out};
}

// Rotates x [T, H, D] in place by each token's position: cos and sin are float32 tables [max_position, D]. Each
// token's heads must be contiguous; tokens may be further apart (queries and keys as a slice of the qkv output).
void rotary_embedding_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x: [T, H, D], each token's heads contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "int64 positions, float32 tables");
  const auto pos = positions.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    rotate_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), pos.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  });
}
