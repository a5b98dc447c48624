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
// Why: a kernel that keeps one output per vector (a dot product over the GGUF layout) sums its lanes at the end
// and, in bf16 or int8 dot products, rounds the activations or runs at half the rate of float32 FMAs (measured
// on an Intel Xeon: oneDNN bf16 GEMMs 85 GMAC/s on 2 cores, MKL float32 167). float32 FMAs on weights decoded
// once per panel are the faster way to multiply many rows (prefill chunks, large decode batches), and the
// weights are the file's exactly. Measured against such a kernel (vdpbf16ps on AVX-512, int16 on AVX2), see
// benchmarks/README.md: 1.3-2x at 1 to 256 rows with AVX-512, 1-2.7x with AVX2 (equal at one row).
// Batch invariance: row r's output n is acc = fma(x[r][k], w[k][n], acc) for k = 0, 1, ..., K - 1, whatever
// the number of rows, the tile or the thread: decoding inline (few rows) or into a panel buffer (many) gives
// the same float32 weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "scratch.h"

namespace {

constexpr int64_t kBlock = 32;

// The vector operations the kernel is written in, for AVX-512 (16 lanes) or AVX2 (8 lanes). A tile is two
// vectors wide (32 columns with AVX-512, 16 with AVX2) and has as many rows as the registers allow; each
// output's arithmetic is the same in both, so the two builds give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define SERVAL_PANEL_KERNEL 512
using Vec = __m512;
constexpr int kLanes = 16, kTileRows = 8;  // 16 accumulators + 2 weight vectors of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec load_halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline Vec unsigned_bytes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline Vec signed_bytes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
inline __mmask16 first(int count) { return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }
inline void store_out(float* y, Vec v, int count) { _mm512_mask_storeu_ps(y, first(count), v); }
// float32 to bfloat16 bits, rounding to nearest even as c10::BFloat16 does (NaN to its quiet NaN).
inline void store_out(uint16_t* y, Vec v, int count) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_mask_storeu_epi16(y, first(count), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVAL_PANEL_KERNEL 256
using Vec = __m256;
constexpr int kLanes = 8, kTileRows = 6;  // 12 accumulators + 2 weight vectors + a broadcast of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec load_halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128i load_bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline Vec unsigned_bytes(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline Vec signed_bytes(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline void store_out(float* y, Vec v, int count) {
  if (count >= 8) return _mm256_storeu_ps(y, v);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  std::memcpy(y, lanes, count * sizeof(float));
}
inline void store_out(uint16_t* y, Vec v, int count) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  const __m256i high = _mm256_srli_epi32(rounded, 16);  // < 2^16: packing without saturation
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  if (count >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
  alignas(16) uint16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
  std::memcpy(y, lanes, count * sizeof(uint16_t));
}
#endif

#if defined(SERVAL_PANEL_KERNEL)
constexpr int64_t kCols = 2 * kLanes;  // output columns of a tile

inline Vec low_nibbles(__m128i b) { return unsigned_bytes(_mm_and_si128(b, _mm_set1_epi8(15))); }
inline Vec high_nibbles(__m128i b) { return unsigned_bytes(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15))); }

// Where a tile's two vectors of one block start: their bytes (one row of 16 bytes per input position, or per pair
// of them for q4) and their float16 scales (d at s, m at s + 16).
struct Panels {
  const uint8_t* packed;
  const uint16_t* scales;
  int64_t groups, block_bytes, block_scales;  // per 16-column panel: bytes and float16 scales of one block

  void block(int64_t tile, int64_t g, const uint8_t* q[2], const uint16_t* s[2]) const {
    for (int c = 0; c < 2; ++c) {
      const int64_t column = tile * kCols + c * kLanes;
      const int64_t index = (column / 16) * groups + g;
      q[c] = packed + index * block_bytes + column % 16;
      s[c] = scales + index * block_scales + column % 16;
    }
  }
};

// One block (32 input positions) of a tile's columns, decoded to float32: out[k][0 .. kCols). The same
// instructions as tile_inline's, so the same floats.
template <bool kQ4>
inline void decode_block(const uint8_t* const q[2], const uint16_t* const s[2], float* out) {
  for (int c = 0; c < 2; ++c) {
    const Vec d = load_halves(s[c]);
    if (kQ4) {
      const Vec m = load_halves(s[c] + 16);
      for (int pair = 0; pair < 16; ++pair) {
        const __m128i b = load_bytes(q[c] + pair * 16);
        vstore(out + (2 * pair) * kCols + c * kLanes, vfma(low_nibbles(b), d, m));
        vstore(out + (2 * pair + 1) * kCols + c * kLanes, vfma(high_nibbles(b), d, m));
      }
    } else {
      for (int k = 0; k < kBlock; ++k)
        vstore(out + k * kCols + c * kLanes, vmul(signed_bytes(load_bytes(q[c] + k * 16)), d));
    }
  }
}

// The tile's outputs into y (float32, or bfloat16 bits: rounded here, so no second pass over y).
template <int R, typename Out>
inline void store(Vec (&acc)[R][2], Out* y, int64_t N, int64_t n0) {
  const int64_t cols = std::min<int64_t>(kCols, N - n0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c)
      if (cols > c * kLanes) store_out(y + r * N + n0 + c * kLanes, acc[r][c], static_cast<int>(cols - c * kLanes));
}

// Few rows: each input position's weights are decoded into registers and used at once (the instructions of
// decode_block, so the same floats; at one row, storing and reloading them cost a quarter of the time).
template <bool kQ4, int R, typename Out>
void tile_inline(const Panels& w, int64_t tile, const float* x, int64_t ldx, Out* y, int64_t N) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* q[2];
    const uint16_t* s[2];
    w.block(tile, g, q, s);
    Vec d[2], m[2];
    for (int c = 0; c < 2; ++c) {
      d[c] = load_halves(s[c]);
      if (kQ4) m[c] = load_halves(s[c] + 16);
    }
    const float* xg = x + g * kBlock;
    if (kQ4) {
      for (int pair = 0; pair < 16; ++pair) {
        Vec even[2], odd[2];
        for (int c = 0; c < 2; ++c) {
          const __m128i b = load_bytes(q[c] + pair * 16);
          even[c] = vfma(low_nibbles(b), d[c], m[c]);
          odd[c] = vfma(high_nibbles(b), d[c], m[c]);
        }
        for (int r = 0; r < R; ++r) {
          const Vec xe = vset1(xg[r * ldx + 2 * pair]), xo = vset1(xg[r * ldx + 2 * pair + 1]);
          for (int c = 0; c < 2; ++c) acc[r][c] = vfma(xo, odd[c], vfma(xe, even[c], acc[r][c]));
        }
      }
    } else {
      for (int k = 0; k < kBlock; ++k) {
        Vec wk[2];
        for (int c = 0; c < 2; ++c) wk[c] = vmul(signed_bytes(load_bytes(q[c] + k * 16)), d[c]);
        for (int r = 0; r < R; ++r) {
          const Vec xb = vset1(xg[r * ldx + k]);
          for (int c = 0; c < 2; ++c) acc[r][c] = vfma(xb, wk[c], acc[r][c]);
        }
      }
    }
  }
  store<R, Out>(acc, y, N, tile * kCols);
}

// Many rows: R rows times the tile's decoded weights w[k][kCols], an FMA chain per output over k in order.
template <int R, typename Out>
void tile_buffered(const float* w, int64_t K, const float* x, int64_t ldx, Out* y, int64_t N, int64_t n0) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const Vec w0 = vload(w + k * kCols), w1 = vload(w + k * kCols + kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xb = vset1(x[r * ldx + k]);
      acc[r][0] = vfma(xb, w0, acc[r][0]);
      acc[r][1] = vfma(xb, w1, acc[r][1]);
    }
  }
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
        const uint8_t* q[2];
        const uint16_t* s[2];
        w.block(t, g, q, s);
        decode_block<kQ4>(q, s, panel + g * kBlock * kCols);
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
  TORCH_CHECK(false, "block_panel_linear needs AVX2 with FMA and F16C, or AVX-512 (check block_panel_kernel_available())");
#endif
}
