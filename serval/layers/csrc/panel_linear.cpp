// y = x W^T with W in 4- or 8-bit blocks of 32 weights, laid out in panels of 16 output columns so that a
// decoded vector holds one input position of 16 columns: each output is then one float32 FMA chain over the
// input positions in order, and a tile needs no horizontal sums.
//
// Panel layout (P = N padded to 32, divided by 16; G = blocks per row):
//   q4: panels [P, G, 16, 16]: byte j of pair p holds column j's weight 2p (low nibble) and 2p + 1 (high);
//       scales float16 [P, G, 2, 16] = (d, m) of the 16 columns; w = d * q + m.
//   q8: panels [P, G, 32, 16]: signed byte j of position k is column j's q; scales [P, G, 1, 16]; w = d * q.
// (serval/layers/linear.py builds it from the GGUF layout without loss.)
//
// Why: the vdpbf16ps path (block_quant_linear.cpp) keeps one output per vector and sums its lanes at the end;
// on a CPU whose bf16 dot product runs at half the rate of float32 FMAs (measured here: oneDNN bf16 GEMMs
// 85 GMAC/s on 2 cores, MKL float32 167), float32 FMAs on weights decoded once per panel are the faster way
// to multiply many rows (prefill chunks, large decode batches), and the weights are the file's exactly.
// Batch invariance: row r's output n is acc = fma(x[r][k], w[k][n], acc) for k = 0, 1, ..., K - 1, whatever
// the number of rows, the tile or the thread: decoding inline (few rows) or into a panel buffer (many) gives
// the same float32 weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "scratch.h"

namespace {

constexpr int64_t kBlock = 32, kCols = 32, kTileRows = 8;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define SERVAL_PANEL_KERNEL 1

// One block (32 input positions) of the two 16-column halves of a 32-column tile, decoded to float32:
// out[k][0..31]. Returns nothing else; the same instructions decode for both paths, so the same floats.
template <bool kQ4>
inline void decode_block(const uint8_t* const half[2], const uint16_t* const half_scales[2], float* out) {
  for (int c = 0; c < 2; ++c) {
    const uint8_t* p = half[c];
    const uint16_t* s = half_scales[c];
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    if (kQ4) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      const __m128i nib = _mm_set1_epi8(15);
      for (int pair = 0; pair < 16; ++pair) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + pair * 16));
        const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, nib)));
        const __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib)));
        _mm512_storeu_ps(out + (2 * pair) * kCols + 16 * c, _mm512_fmadd_ps(even, d, m));
        _mm512_storeu_ps(out + (2 * pair + 1) * kCols + 16 * c, _mm512_fmadd_ps(odd, d, m));
      }
    } else {
      for (int k = 0; k < kBlock; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * 16));
        _mm512_storeu_ps(out + k * kCols + 16 * c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d));
      }
    }
  }
}

// Rows r0 .. r0 + R of x (float32, ldx apart) times ``steps`` decoded input positions w[k][32], added into acc.
template <int R>
inline void accumulate(__m512 (&acc)[R][2], const float* x, int64_t ldx, const float* w, int64_t steps) {
  for (int64_t k = 0; k < steps; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * kCols), w1 = _mm512_loadu_ps(w + k * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
}

// float32 to bfloat16 bits, rounding to nearest even as c10::BFloat16 does (NaN to its quiet NaN).
inline __m256i to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The tile's outputs into y (float32, or bfloat16 bits: rounded here, so no second pass over y).
template <int R, typename Out>
inline void store(__m512 (&acc)[R][2], Out* y, int64_t N, int64_t n0) {
  const int64_t cols = std::min<int64_t>(kCols, N - n0);
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(y + r * N + n0, lo, acc[r][0]);
      _mm512_mask_storeu_ps(y + r * N + n0 + 16, hi, acc[r][1]);
    } else {
      _mm256_mask_storeu_epi16(y + r * N + n0, lo, to_bfloat16(acc[r][0]));
      _mm256_mask_storeu_epi16(y + r * N + n0 + 16, hi, to_bfloat16(acc[r][1]));
    }
  }
}

struct Panels {
  const uint8_t* packed;
  const uint16_t* scales;
  int64_t groups, block_bytes, block_scales;  // per 16-column half: bytes and float16 scales of one block

  void block(int64_t tile, int64_t g, const uint8_t* half[2], const uint16_t* half_scales[2]) const {
    for (int c = 0; c < 2; ++c) {
      const int64_t index = (2 * tile + c) * groups + g;
      half[c] = packed + index * block_bytes;
      half_scales[c] = scales + index * block_scales;
    }
  }
};

// Few rows: each input position's weights are decoded into registers and used at once (the instructions of
// decode_block, so the same floats; at one row, storing and reloading them cost a quarter of the time).
template <bool kQ4, int R, typename Out>
void tile_inline(const Panels& w, int64_t tile, const float* x, int64_t ldx, Out* y, int64_t N) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m128i nib = _mm_set1_epi8(15);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* half[2];
    const uint16_t* half_scales[2];
    w.block(tile, g, half, half_scales);
    __m512 d[2], m[2];
    for (int c = 0; c < 2; ++c) {
      d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half_scales[c])));
      if (kQ4) m[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half_scales[c] + 16)));
    }
    const float* xg = x + g * kBlock;
    if (kQ4) {
      for (int pair = 0; pair < 16; ++pair) {
        __m512 even[2], odd[2];
        for (int c = 0; c < 2; ++c) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half[c] + pair * 16));
          even[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, nib))), d[c], m[c]);
          odd[c] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib))), d[c], m[c]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xe = _mm512_set1_ps(xg[r * ldx + 2 * pair]), xo = _mm512_set1_ps(xg[r * ldx + 2 * pair + 1]);
          for (int c = 0; c < 2; ++c) acc[r][c] = _mm512_fmadd_ps(xo, odd[c], _mm512_fmadd_ps(xe, even[c], acc[r][c]));
        }
      }
    } else {
      for (int k = 0; k < kBlock; ++k) {
        __m512 wk[2];
        for (int c = 0; c < 2; ++c)
          wk[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(half[c] + k * 16)))), d[c]);
        for (int r = 0; r < R; ++r) {
          const __m512 xb = _mm512_set1_ps(xg[r * ldx + k]);
          for (int c = 0; c < 2; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wk[c], acc[r][c]);
        }
      }
    }
  }
  store<R, Out>(acc, y, N, tile * kCols);
}

template <int R, typename Out>
void tile_buffered(const float* panel, int64_t K, const float* x, int64_t ldx, Out* y, int64_t N, int64_t n0) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  accumulate<R>(acc, x, ldx, panel, K);
  store<R, Out>(acc, y, N, n0);
}

template <bool kQ4, int R, typename Out>
void rows_inline(int64_t rows, const Panels& w, int64_t tile, const float* x, int64_t ldx, Out* y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tile_inline<kQ4, R, Out>(w, tile, x, ldx, y, N);
    rows_inline<kQ4, R - 1, Out>(rows, w, tile, x, ldx, y, N);
  }
}

template <int R, typename Out>
void rows_buffered(int64_t rows, const float* panel, int64_t K, const float* x, int64_t ldx, Out* y, int64_t N,
                   int64_t n0) {
  if constexpr (R > 0) {
    if (rows == R) return tile_buffered<R, Out>(panel, K, x, ldx, y, N, n0);
    rows_buffered<R - 1, Out>(rows, panel, K, x, ldx, y, N, n0);
  }
}

template <bool kQ4, typename Out>
void gemm_panels(const float* x, int64_t M, int64_t K, const Panels& w, int64_t N, Out* y) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if (M <= kTileRows) {
      for (int64_t t = begin; t < end; ++t) rows_inline<kQ4, kTileRows, Out>(M, w, t, x, K, y, N);
      return;
    }
    // Many rows: the tile's weights are decoded once for all of them.
    float* panel = serval::scratch(0, K * kCols);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* half[2];
        const uint16_t* half_scales[2];
        w.block(t, g, half, half_scales);
        decode_block<kQ4>(half, half_scales, panel + g * kBlock * kCols);
      }
      int64_t r0 = 0;
      for (; r0 + kTileRows <= M; r0 += kTileRows)
        tile_buffered<kTileRows, Out>(panel, K, x + r0 * K, K, y + r0 * N, N, t * kCols);
      rows_buffered<kTileRows - 1, Out>(M - r0, panel, K, x + r0 * K, K, y + r0 * N, N, t * kCols);
    }
  });
}
#endif

}  // namespace

bool block_panel_kernel_available() {
#if defined(SERVAL_PANEL_KERNEL)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32 or bfloat16); panels uint8 [P, G, 16 (q4) or 32 (q8), 16], scales float16 [P, G, 2 or 1, 16]
// with P * 16 >= N, P even and G * 32 >= K. Returns y [M, N] in x's dtype, or in float32 with float_output (logits:
// rounding them to bfloat16 would tie tokens whose scores differ by less than 1/8 at magnitude 16).
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                              const std::string& format, int64_t out_features, bool float_output) {
  TORCH_CHECK(format == "q4" || format == "q8", "unknown block format ", format);
  const bool q4 = format == "q4";
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(2) == (q4 ? 16 : 32) && panels.size(3) == 16 && panels.size(0) % 2 == 0,
              "panels: uint8 [P (even), G, 16 or 32, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, groups = panels.size(1);
  TORCH_CHECK(panels.size(0) * 16 >= N && groups * kBlock >= K, "panels must cover the weight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == panels.size(0) * groups * (q4 ? 2 : 1) * 16, "scales: float16 [P, G, 2 or 1, 16]");
#if defined(SERVAL_PANEL_KERNEL)
  // The activations in float32, rows padded with zeros to the blocks' width; converted here rather than by
  // aten ops: at one row a call's fixed costs are a good part of its time.
  const int64_t padded = groups * kBlock;
  float* xf = serval::scratch(1, M * padded);  // slot 0 is the panels' (this thread works on them too)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "block_panel_linear", [&] {
    const at::Tensor xc = x.contiguous();
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t k = 0; k < K; ++k) xf[r * padded + k] = static_cast<float>(src[r * K + k]);
      for (int64_t k = K; k < padded; ++k) xf[r * padded + k] = 0.f;
    }
  });
  const Panels w{panels.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), groups,
                 q4 ? 16 * 16 : 32 * 16, (q4 ? 2 : 1) * 16};
  if (x.scalar_type() == at::kBFloat16 && !float_output) {
    at::Tensor y = at::empty({M, N}, x.options());
    auto* yb = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    q4 ? gemm_panels<true>(xf, M, padded, w, N, yb) : gemm_panels<false>(xf, M, padded, w, N, yb);
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yf = y.data_ptr<float>();
  q4 ? gemm_panels<true>(xf, M, padded, w, N, yf) : gemm_panels<false>(xf, M, padded, w, N, yf);
  return float_output ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "block_panel_linear needs AVX-512 (check block_panel_kernel_available())");
#endif
}
