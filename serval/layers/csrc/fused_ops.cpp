// Small per-token ops fused into one pass each, for the decode step where every aten call's fixed cost adds up
// (61 norms and 30 rotations per step for a 30-layer model). Each reproduces the PyTorch path's roundings: results
// are float32 inside and rounded to the tensor's dtype exactly where the PyTorch code rounds. Rows are computed
// independently and in a fixed order, so a row's result never depends on the others in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "thread_pool.h"
#include "vec_math.h"
#if defined(SERVAL_V16)
#include <sleef.h>  // the tanh PyTorch's gelu takes (libtorch_cpu exports it)
#endif

namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                       int64_t n, float eps) {
  serval::parallel_for(0, rows, std::max<int64_t>(1, 4096 / n), [&](int64_t begin, int64_t end) {
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
  serval::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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


// silu(g) = g / (1 + e^-g), with e^-|g| so the exponent is never positive (no overflow for very negative g).
inline float silu(float g) {
  const float e = std::exp(-std::fabs(g));
  return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

// out[r] = silu(gate[r]) * up[r] for x [rows, 2n] = [gate | up], each product of values rounded to T as the
// PyTorch lines (F.silu(gate) * up) round them.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  serval::parallel_for(0, rows, std::max<int64_t>(1, 8192 / n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = x + row * 2 * n;
      const T* up = gate + n;
      T* o = out + row * n;
      int64_t i = 0;
#if defined(SERVAL_V16)
      float s[16];
      for (; i < n; i += 16) {  // 16 at a time (the same bits with AVX-512 and AVX2); the last ones padded
        const int64_t count = std::min<int64_t>(16, n - i);
        for (int j = 0; j < 16; ++j) s[j] = j < count ? static_cast<float>(gate[i + j]) : 0.f;
        serval::store16(s, serval::silu16(serval::load16(s)));
        for (int j = 0; j < count; ++j) o[i + j] = static_cast<T>(round_to<T>(s[j]) * static_cast<float>(up[i + j]));
      }
#endif
      for (; i < n; ++i) o[i] = static_cast<T>(round_to<T>(silu(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
    }
  });
}

// ---- Gemma (gemma_rms_norm, gelu_tanh_and_mul): the same bits as the PyTorch lines of layers/norm.py and
// layers/activation.py, op for op, including the order in which PyTorch's CPU kernels sum and where they round.

// An opaque copy: the compiler can not fuse the product it holds into a following add (an FMA would skip the
// product's rounding, which PyTorch rounds: there the product is its own kernel's output).
inline float kept(float v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile float copy = v;
  v = copy;
#endif
  return v;
}

// sum(r[i]^2) in the order of PyTorch's CPU sum over a contiguous row (x.pow(2).mean(-1)): the row as vectors of
// `lanes` floats, added lane by lane into 4 accumulators (vector j into j % 4) in blocks cascaded over 4 levels
// (at::native's multi_row_sum, level blocks of 2^max(4, ceil_log2(m / 4) / 4) steps), the vectors past the last
// 4 into accumulator 0, accumulators 1-3 folded into 0; then the values past the last vector summed, and the lanes
// added to that in order. lanes: PyTorch's float vector width on this CPU (16 with AVX-512, 8 with AVX2).
inline float torch_sum_of_squares(const float* r, int64_t n, int64_t lanes) {
  constexpr int kLevels = 4, kIlp = 4, kMaxLanes = 16;
  float acc[kLevels][kIlp][kMaxLanes] = {};
  const int64_t vectors = n / lanes, steps = vectors / kIlp;
  auto add_vector = [&](float* a, int64_t v) {
    for (int64_t l = 0; l < lanes; ++l) a[l] += kept(r[v * lanes + l] * r[v * lanes + l]);
  };
  int64_t ceil_log2 = 1;
  if (steps > 2) ceil_log2 = 64 - __builtin_clzll(static_cast<uint64_t>(steps - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  while (i + level_step <= steps) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int level = 1; level < kLevels; ++level) {
      for (int k = 0; k < kIlp; ++k)
        for (int64_t l = 0; l < lanes; ++l) acc[level][k][l] += acc[level - 1][k][l], acc[level - 1][k][l] = 0.f;
      if ((i & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int level = 1; level < kLevels; ++level)
    for (int k = 0; k < kIlp; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = steps * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.f;
  for (int64_t k = vectors * lanes; k < n; ++k) sum += kept(r[k] * r[k]);
  for (int64_t l = 0; l < lanes; ++l) sum += acc[0][0][l];
  return sum;
}

// Gemma's RMSNorm of one row as norm.py's PyTorch lines compute it: r * (1 / sqrt(sum / n + eps)) (rsqrt is
// 1 / sqrt there, each correctly rounded), times (1 + w) rounded to float32, rounded to T once. r: the row as floats.
template <typename T>
inline void gemma_norm_row(const float* r, const T* weight, T* out, int64_t n, float eps, int64_t lanes) {
  const float inv = 1.f / std::sqrt(torch_sum_of_squares(r, n, lanes) / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<T>(kept(kept(r[k] * inv) * (1.f + static_cast<float>(weight[k]))));
}

// Rows of n values (queries or keys of one head: a [tokens, heads, D] view into the qkv output is tokens * heads
// rows with a token stride). Without a residual: out = norm(x). With one: residual_out = residual + norm(x) rounded
// to T (Gemma's sublayer output joining the residual stream, as the PyTorch add rounds it), and out =
// next_norm(residual_out) when next_weight is given (the next sublayer's pre-norm).
template <typename T>
void gemma_rms_norm_rows(const T* x, int64_t heads, int64_t token_stride, const T* weight, T* out,
                         const T* residual, T* residual_out, const T* next_weight, int64_t rows, int64_t n,
                         float eps, int64_t lanes) {
  serval::parallel_for(0, rows, std::max<int64_t>(1, 4096 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    std::vector<T> normed(residual ? n : 0);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + (row / heads) * token_stride + (row % heads) * n;
      for (int64_t i = 0; i < n; ++i) r[i] = static_cast<float>(xr[i]);
      if (!residual) {
        gemma_norm_row<T>(r.data(), weight, out + row * n, n, eps, lanes);
        continue;
      }
      gemma_norm_row<T>(r.data(), weight, normed.data(), n, eps, lanes);
      for (int64_t i = 0; i < n; ++i) {
        r[i] = round_to<T>(static_cast<float>(residual[row * n + i]) + static_cast<float>(normed[i]));
        residual_out[row * n + i] = static_cast<T>(r[i]);
      }
      if (next_weight) gemma_norm_row<T>(r.data(), next_weight, out + row * n, n, eps, lanes);
    }
  });
}

// gelu with the tanh approximation as PyTorch's CPU kernel (ATen/native/cpu/Gelu.h) computes it:
// 0.5 x (1 + tanh(beta (x + kappa x^3))), x + kappa x^3 one FMA (as PyTorch's build contracts it), the tanh
// SLEEF's (1 ulp) in vectors and libm's for the values past PyTorch's last pair of vectors.
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
constexpr float kGeluKappa = static_cast<float>(0.044715);

inline float gelu_tanh(float x) {
  const float inner = kept(kGeluBeta * std::fma(kGeluKappa, kept(kept(x * x) * x), x));
  return kept(0.5f * x) * (1.f + std::tanh(inner));
}
#if defined(SERVAL_V16)
inline __m256 kept(__m256 v) {
  asm("" : "+x"(v));
  return v;
}
inline __m256 gelu_tanh(__m256 x) {
  const __m256 cube = kept(_mm256_mul_ps(kept(_mm256_mul_ps(x, x)), x));
  const __m256 inner = kept(_mm256_mul_ps(_mm256_set1_ps(kGeluBeta),
                                          _mm256_fmadd_ps(_mm256_set1_ps(kGeluKappa), cube, x)));
  return _mm256_mul_ps(kept(_mm256_mul_ps(_mm256_set1_ps(0.5f), x)),
                       _mm256_add_ps(_mm256_set1_ps(1.f), Sleef_tanhf8_u10(inner)));
}
#if defined(__AVX512F__)
inline __m512 kept(__m512 v) {
  asm("" : "+v"(v));
  return v;
}
inline __m512 gelu_tanh(__m512 x) {
  const __m512 cube = kept(_mm512_mul_ps(kept(_mm512_mul_ps(x, x)), x));
  const __m512 inner = kept(_mm512_mul_ps(_mm512_set1_ps(kGeluBeta),
                                          _mm512_fmadd_ps(_mm512_set1_ps(kGeluKappa), cube, x)));
  return _mm512_mul_ps(kept(_mm512_mul_ps(_mm512_set1_ps(0.5f), x)),
                       _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_tanhf16_u10(inner)));
}
inline void gelu_tanh16(float* s) { _mm512_storeu_ps(s, gelu_tanh(_mm512_loadu_ps(s))); }
#else
inline void gelu_tanh16(float* s) {
  _mm256_storeu_ps(s, gelu_tanh(_mm256_loadu_ps(s)));
  _mm256_storeu_ps(s + 8, gelu_tanh(_mm256_loadu_ps(s + 8)));
}
#endif
#endif

// out[r] = gelu_tanh(gate[r]) * up[r] for x [rows, 2n] = [gate | up]: the gelu rounded to T, then the product of
// values rounded (F.gelu(gate) * up). PyTorch's elementwise loop takes each row's first n - n % vector_values in
// vectors and the rest one by one (vector_values: two of its vectors of T, 64 bf16 or 32 floats with AVX-512).
template <typename T>
void gelu_tanh_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t vector_values) {
  const int64_t vectorized = n - n % vector_values;
  serval::parallel_for(0, rows, std::max<int64_t>(1, 8192 / n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = x + row * 2 * n;
      const T* up = gate + n;
      T* o = out + row * n;
      int64_t i = 0;
#if defined(SERVAL_V16)
      alignas(64) float s[16];
      for (; i + 16 <= vectorized; i += 16) {  // lane by lane: the same bits at any vector width
        for (int j = 0; j < 16; ++j) s[j] = static_cast<float>(gate[i + j]);
        gelu_tanh16(s);
        for (int j = 0; j < 16; ++j) o[i + j] = static_cast<T>(round_to<T>(s[j]) * static_cast<float>(up[i + j]));
      }
#endif
      for (; i < n; ++i)
        o[i] = static_cast<T>(round_to<T>(gelu_tanh(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
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

// x [rows, 2n] = [gate | up] -> silu(gate) * up [rows, n].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x: contiguous [rows, 2n]");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n);
  });
  return out;
}

// Gemma's RMSNorm, x / rms(x) * (1 + weight) in float32, for x [..., n] (contiguous, or [T, H, n] with each
// token's heads contiguous: per-head queries or keys inside the qkv output). Without residual: returns
// (norm(x), x). With residual [rows, n]: r = residual + norm(x) (rounded to the dtype), and returns
// (next_norm(r), r) if next_weight is given, else (r, r). lanes: PyTorch's float vector width on this CPU, the
// order of its sums (norm.py finds it by comparing with the PyTorch lines).
std::tuple<at::Tensor, at::Tensor> gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                  int64_t lanes, const c10::optional<at::Tensor>& residual,
                                                  const c10::optional<at::Tensor>& next_weight) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(lanes == 4 || lanes == 8 || lanes == 16, "lanes: 4, 8 or 16");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [n], x's dtype");
  int64_t heads = 1, token_stride = n;
  if (!x.is_contiguous()) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == n,
                "x: contiguous, or [T, H, n] with each token's heads contiguous");
    heads = x.size(1), token_stride = x.stride(0);
  }
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const bool has_residual = residual.has_value() && residual->defined();
  const bool has_next = next_weight.has_value() && next_weight->defined();
  TORCH_CHECK(!has_residual || (residual->is_contiguous() && residual->numel() == x.numel() &&
                                residual->scalar_type() == x.scalar_type()), "residual: contiguous, like x");
  TORCH_CHECK(!has_next || (has_residual && next_weight->is_contiguous() && next_weight->numel() == n &&
                            next_weight->scalar_type() == x.scalar_type()), "next_weight: like weight, with a residual");
  const auto shape = has_residual ? residual->sizes() : x.sizes();
  at::Tensor residual_out = has_residual ? at::empty(shape, x.options()) : x;
  at::Tensor out = has_residual && !has_next ? residual_out : at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_rms_norm", [&] {
    gemma_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), heads, token_stride, weight.data_ptr<scalar_t>(),
                                  has_residual && !has_next ? nullptr : out.data_ptr<scalar_t>(),
                                  has_residual ? residual->data_ptr<scalar_t>() : nullptr,
                                  has_residual ? residual_out.data_ptr<scalar_t>() : nullptr,
                                  has_next ? next_weight->data_ptr<scalar_t>() : nullptr, rows, n,
                                  static_cast<float>(eps), lanes);
  });
  return {out, residual_out};
}

// x [rows, 2n] = [gate | up] -> gelu_tanh(gate) * up [rows, n] (Gemma's GeGLU). lanes: PyTorch's float vector
// width on this CPU (which values its loop takes in vectors; activation.py finds it by comparing).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x: contiguous [rows, 2n]");
  TORCH_CHECK(lanes == 4 || lanes == 8 || lanes == 16, "lanes: 4, 8 or 16");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_and_mul", [&] {
    const int64_t vector_values = 2 * lanes * static_cast<int64_t>(sizeof(float) / sizeof(scalar_t));
    gelu_tanh_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n, vector_values);
  });
  return out;
}

// The index of each row's largest value (the first of equal ones; the first NaN if any, as torch.argmax), for
// x float32 [rows, n]: torch.argmax took 0.7-1.7 ms for 16 rows of a 49k vocabulary here. AVX-512 or AVX2 lanes.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x: contiguous float32 [rows, n]");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  serval::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* v = data + row * n;
      float best = v[0];
      int64_t at = 0, i = 0;
#if defined(__AVX512F__)
      // Per lane: its largest value and where it first was; then the smallest index among lanes holding the max.
      if (n >= 16) {
        __m512 lane_best = _mm512_loadu_ps(v);
        __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = lane_at;
        __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n && !nan; i += 16) {
          idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
          const __m512 w = _mm512_loadu_ps(v + i);
          nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
          const __mmask16 greater = _mm512_cmp_ps_mask(w, lane_best, _CMP_GT_OQ);
          lane_best = _mm512_mask_mov_ps(lane_best, greater, w);
          lane_at = _mm512_mask_mov_epi32(lane_at, greater, idx);
        }
        if (nan) {  // rare: the scalar loop below scans the row again and stops at its first NaN
          i = 0;
        } else {
          alignas(64) float b[16];
          alignas(64) int32_t a[16];
          _mm512_store_ps(b, lane_best);
          _mm512_store_si512(a, lane_at);
          best = b[0], at = a[0];
          for (int l = 1; l < 16; ++l)
            if (b[l] > best || (b[l] == best && a[l] < at)) best = b[l], at = a[l];
        }
      }
#elif defined(SERVAL_V16)
      if (n >= 8) {  // as above, 8 lanes
        __m256 lane_best = _mm256_loadu_ps(v);
        __m256i lane_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i idx = lane_at;
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(lane_best, lane_best, _CMP_UNORD_Q));
        for (i = 8; i + 8 <= n && !nan; i += 8) {
          idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
          const __m256 w = _mm256_loadu_ps(v + i);
          nan = _mm256_movemask_ps(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
          const __m256 greater = _mm256_cmp_ps(w, lane_best, _CMP_GT_OQ);
          lane_best = _mm256_blendv_ps(lane_best, w, greater);
          lane_at = _mm256_castps_si256(
              _mm256_blendv_ps(_mm256_castsi256_ps(lane_at), _mm256_castsi256_ps(idx), greater));
        }
        if (nan) {
          i = 0;
        } else {
          alignas(32) float b[8];
          alignas(32) int32_t a[8];
          _mm256_store_ps(b, lane_best);
          _mm256_store_si256(reinterpret_cast<__m256i*>(a), lane_at);
          best = b[0], at = a[0];
          for (int l = 1; l < 8; ++l)
            if (b[l] > best || (b[l] == best && a[l] < at)) best = b[l], at = a[l];
        }
      }
#endif
      for (; i < n; ++i) {
        if (std::isnan(v[i])) {
          at = i;
          break;
        }
        if (v[i] > best) best = v[i], at = i;
      }
      index[row] = at;
    }
  });
  return out;
}
