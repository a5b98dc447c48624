// y = x W^T with W kept in 4- or 8-bit blocks of 32 weights along the input dimension, as GGUF stores them.
//
// Weight formats (float16 scales; G = blocks per row):
//   q4: packed [N, G, 16], byte i of a block holds weight i (low nibble) and weight i + 16 (high nibble);
//       scales [N, G, 2] = (d, m); w = d * q + m (GGUF Q4_1 as stored; Q4_0 is the same with m = -8 d).
//   q8: packed [N, G, 32] signed bytes q; scales [N, G, 1] = d; w = d * q (GGUF Q8_0 as stored).
//
// Activations are quantized per row and block of 32 to int16 (scale max|x| / 32767: an error 64 times smaller
// than rounding them to bfloat16), so a block's dot product is one exact integer sum (vpdpwssd / pmaddwd); the
// Q4_1 minimum multiplies the float sum of the block's activations. Floats are then accumulated per lane in
// block order and the lanes summed in a fixed order. Batch invariance: every step depends only on the row
// itself, never on how many rows share the call, the tile a row falls in or the thread that computes it.
// (Used where panel_linear.cpp is not built: CPUs without AVX-512. A vdpbf16ps path for bfloat16 activations
// lived here; with AVX-512 the panel kernel's float32 FMAs are faster, on the file's exact weights.)
// (int8 activations, as llama.cpp uses, were measured here: 2x faster per row, but greedy top-1 agreement with
// the file's float model fell to 89% of positions on a chat prompt.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Activations of one call, quantized: q [rows, K] int16, d [rows, G] scales, sum [rows, G] float sums of x.
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> d, sum;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k_in, int64_t groups) {
  const int64_t K = groups * kBlock;
  QuantizedRows out{std::vector<int16_t>(rows * K, 0), std::vector<float>(rows * groups, 0.f),
                    std::vector<float>(rows * groups, 0.f)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float v[kBlock] = {0.f};
      const int64_t start = g * kBlock, n = std::max<int64_t>(0, std::min<int64_t>(kBlock, k_in - start));
      std::memcpy(v, x + r * k_in + start, n * sizeof(float));
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* q = out.q.data() + r * K + start;
      for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int16_t>(std::nearbyint(v[i] * inv));
      out.d[r * groups + g] = amax / 32767.f;
      out.sum[r * groups + g] = sum;
    }
  }
  return out;
}

// The exact integer dot product of one weight block with one activation block. Not vectorized: GCC 12's
// vectorizer was seen to turn a signed x signed byte dot product into an unsigned x signed one at -O3.
__attribute__((optimize("no-tree-vectorize"))) inline int32_t block_dot_q4(const uint8_t* w, const int16_t* x) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += (w[i] & 15) * x[i] + (w[i] >> 4) * x[i + 16];
  return s;
}

__attribute__((optimize("no-tree-vectorize"))) inline int32_t block_dot_q8(const uint8_t* w, const int16_t* x) {
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += static_cast<int8_t>(w[i]) * x[i];
  return s;
}

// Portable path: one float per (row, column), blocks in order.
template <bool kQ4>
void gemm_generic(const QuantizedRows& xq, int64_t rows, int64_t groups, int64_t N, const uint8_t* packed,
                  const uint16_t* scales, float* y) {
  const int64_t bytes = kQ4 ? 16 : 32, nscales = kQ4 ? 2 : 1, K = groups * kBlock;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* w = packed + (n * groups + g) * bytes;
          const uint16_t* s = scales + (n * groups + g) * nscales;
          const int16_t* x = xq.q.data() + r * K + g * kBlock;
          const int32_t dot = kQ4 ? block_dot_q4(w, x) : block_dot_q8(w, x);
          acc += static_cast<float>(dot) * (xq.d[r * groups + g] * half_to_float(s[0]));
          if (kQ4) acc += half_to_float(s[1]) * xq.sum[r * groups + g];
        }
        y[r * N + n] = acc;
      }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SERVAL_BLOCK_KERNEL "avx512"
// One block per vector: its 32 weights as int16, 16 int32 lanes of pair sums.
constexpr int kRows = 4, kCols = 4;  // 16 accumulators + 12 vectors of weights and scales: 28 of 32 registers

inline __m512i pair_sums(__m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, x);
#else
  return _mm512_madd_epi16(w, x);
#endif
}

template <bool kQ4, int R>
inline void tile(const QuantizedRows& xq, int64_t r0, int64_t groups, int64_t N, int64_t n0, int64_t cols,
                 const uint8_t* packed, const uint16_t* scales, float* y) {
  const int64_t bytes = kQ4 ? 16 : 32, nscales = kQ4 ? 2 : 1, K = groups * kBlock;
  __m512 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[kCols];
    __m512 d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      const int64_t block = (n0 + std::min<int64_t>(c, cols - 1)) * groups + g;  // short tile: repeat a column
      const uint8_t* wp = packed + block * bytes;
      const uint16_t* s = scales + block * nscales;
      if (kQ4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)), nib = _mm_set1_epi8(15);
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
        w[c] = _mm512_cvtepu8_epi16(q);
        m[c] = _mm512_set1_ps(_cvtsh_ss(s[1]));
      } else {
        w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
      }
      d[c] = _mm512_set1_ps(_cvtsh_ss(s[0]));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const __m512i x = _mm512_loadu_si512(xq.q.data() + row * K + g * kBlock);
      const __m512 xd = _mm512_set1_ps(xq.d[row * groups + g]);
      const __m512 xsum = _mm512_set1_ps(xq.sum[row * groups + g] / 16.f);  // 16 lanes add a share each, exactly
      for (int c = 0; c < kCols; ++c) {
        const __m512 dot = _mm512_cvtepi32_ps(pair_sums(w[c], x));
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(dot, xd), d[c], acc[r][c]);
        if (kQ4) acc[r][c] = _mm512_fmadd_ps(m[c], xsum, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) y[(r0 + r) * N + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVAL_BLOCK_KERNEL "avx2"
// One block per two vectors of 16 int16; eight int32 lanes of pair sums.
constexpr int kRows = 2, kCols = 2;  // 16 registers: 4 accumulators, 4 weight vectors, scales, activations

template <bool kQ4, int R>
inline void tile(const QuantizedRows& xq, int64_t r0, int64_t groups, int64_t N, int64_t n0, int64_t cols,
                 const uint8_t* packed, const uint16_t* scales, float* y) {
  const int64_t bytes = kQ4 ? 16 : 32, nscales = kQ4 ? 2 : 1, K = groups * kBlock;
  __m256 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w_lo[kCols], w_hi[kCols];
    __m256 d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) {
      const int64_t block = (n0 + std::min<int64_t>(c, cols - 1)) * groups + g;
      const uint8_t* wp = packed + block * bytes;
      const uint16_t* s = scales + block * nscales;
      if (kQ4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)), nib = _mm_set1_epi8(15);
        w_lo[c] = _mm256_cvtepu8_epi16(_mm_and_si128(b, nib));
        w_hi[c] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
        m[c] = _mm256_set1_ps(_cvtsh_ss(s[1]));
      } else {
        w_lo[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
        w_hi[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
      }
      d[c] = _mm256_set1_ps(_cvtsh_ss(s[0]));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int16_t* xr = xq.q.data() + row * K + g * kBlock;
      const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
      const __m256 xd = _mm256_set1_ps(xq.d[row * groups + g]);
      const __m256 xsum = _mm256_set1_ps(xq.sum[row * groups + g] / 8.f);
      for (int c = 0; c < kCols; ++c) {
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(w_lo[c], x_lo), _mm256_madd_epi16(w_hi[c], x_hi));
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), xd), d[c], acc[r][c]);
        if (kQ4) acc[r][c] = _mm256_fmadd_ps(m[c], xsum, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][c]);
      float sum = 0.f;
      for (float v : lanes) sum += v;
      y[(r0 + r) * N + n0 + c] = sum;
    }
}
#endif

#if defined(SERVAL_BLOCK_KERNEL)
// Column tiles across threads; in each, full row tiles, then one shorter tile of its own size (never padding).
template <bool kQ4>
void gemm_simd(const QuantizedRows& xq, int64_t rows, int64_t groups, int64_t N, const uint8_t* packed,
               const uint16_t* scales, float* y) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kCols, cols = std::min<int64_t>(kCols, N - n0);
      int64_t r0 = 0;
      for (; r0 + kRows <= rows; r0 += kRows) tile<kQ4, kRows>(xq, r0, groups, N, n0, cols, packed, scales, y);
      switch (rows - r0) {
        case 3: tile<kQ4, std::min(3, kRows - 1)>(xq, r0, groups, N, n0, cols, packed, scales, y); break;
        case 2: tile<kQ4, std::min(2, kRows - 1)>(xq, r0, groups, N, n0, cols, packed, scales, y); break;
        case 1: tile<kQ4, 1>(xq, r0, groups, N, n0, cols, packed, scales, y); break;
        default: break;
      }
    }
  });
}
#else
#define SERVAL_BLOCK_KERNEL "generic"
template <bool kQ4>
void gemm_simd(const QuantizedRows& xq, int64_t rows, int64_t groups, int64_t N, const uint8_t* packed,
               const uint16_t* scales, float* y) {
  gemm_generic<kQ4>(xq, rows, groups, N, packed, scales, y);
}
#endif



}  // namespace

// x [M, K] (float32, bfloat16 or float16); packed uint8 [N, G, 16 (q4) or 32 (q8)] with G * 32 >= K; scales float16 [N, G, 2 (q4) or 1 (q8)]; format "q4" or "q8". Returns y [M, N] in x's dtype.
at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const std::string& format) {
  TORCH_CHECK(format == "q4" || format == "q8", "unknown block format ", format);
  const bool q4 = format == "q4";
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == (q4 ? 16 : 32), "packed: uint8 [N, G, bytes per block]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(groups * kBlock >= K, "packed blocks must cover K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == N * groups * (q4 ? 2 : 1), "scales: float16 [N, G, 2 or 1]");
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), M, K, groups);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (q4)
    gemm_simd<true>(xq, M, groups, N, w, s, y.data_ptr<float>());
  else
    gemm_simd<false>(xq, M, groups, N, w, s, y.data_ptr<float>());
  return y.to(x.scalar_type());
}

// Which path this build compiled: "avx512", "avx2" or "generic".
std::string block_quant_kernel() { return SERVAL_BLOCK_KERNEL; }

// The portable path, whatever this build compiled, for tests to check the SIMD paths against.
at::Tensor block_quant_linear_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                        const std::string& format) {
  const bool q4 = format == "q4";
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), groups = packed.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), M, K, groups);
  at::Tensor y = at::empty({M, N}, xf.options());
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (q4)
    gemm_generic<true>(xq, M, groups, N, packed.data_ptr<uint8_t>(), s, y.data_ptr<float>());
  else
    gemm_generic<false>(xq, M, groups, N, packed.data_ptr<uint8_t>(), s, y.data_ptr<float>());
  return y;
}
