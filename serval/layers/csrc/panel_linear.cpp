// y = x W^T with W in 4- to 8-bit blocks of 32 weights, laid out in panels of 16 output columns so that a
// decoded vector holds one input position of 16 columns: each output is then one float32 FMA chain over the
// input positions in order, and a tile needs no horizontal sums.
//
// Panel layout (P = N padded to 32, divided by 16; G = blocks per row):
//   q4: panels [P, G, 16, 16]: byte j of pair p holds column j's code 2p (low nibble) and 2p + 1 (high);
//       scales float16 [P, G, 2, 16] = (d, m) of the 16 columns; w = d * q + m (GGUF Q4_0, Q4_1).
//   q5: q4's 16 rows and 4 rows of the fifth bit (row 16 + k / 8, bit k % 8 for position k); scales as q4's
//       (GGUF Q5_0, Q5_1).
//   q4k, q5k (GGUF Q4_K, Q5_K): q4's and q5's bytes; scales as the file keeps them, uint8 [P, G / 8, 320]: per
//       super-block of 256 positions its 16 columns' float16 d and -dmin (2 rows of 16), then per block of 32
//       the 16 columns' 6-bit sub-block scale sc and min mn (2 rows of 16 bytes); w = (d sc) q + (-dmin mn).
//   q6k (GGUF Q6_K): q4's 16 rows and 8 rows of the two high bits (row 16 + k / 4, bits 2 (k % 4) and up);
//       scales uint8 [P, G / 8, 288]: per super-block the float16 d (1 row of 16), then per block the int8 sc of
//       positions 0-15 and of 16-31 (2 rows of 16 bytes); w = (d sc) (q - 32), computed as fma(q, d sc, -32 d sc).
//   q4f, q5f, q6f: q4k's, q5k's and q6k's bytes with their products d sc (and -dmin mn) as float32 scales
//       [P, G, 2, 16] (a slice that cuts super-blocks; Q5_0 as q5f where its -16 d overflows float16).
//   The K formats' block scales are formed here as float(d) * float(sc): a float16 times a 6- or 8-bit integer
//   is exact in float32, so they equal the float32 formats' scales and give the same bits (0.08 bytes of scales
//   per weight instead of 0.25).
//   q8: panels [P, G, 32, 16]: signed byte j of position k is column j's q; scales [P, G, 1, 16]; w = d * q.
//   bf16, f32 (dense weights, dense_panel_linear): no blocks to decode and no scales; the weight transposed,
//   W^T [K, N] row-major (a model's Linear holds it as the [N, K] view of it, so there is one copy): a block of
//   32 input positions of a tile is 32 rows of W^T, each kCols columns side by side (widened to float32).
// (serval/layers/linear.py builds it from the GGUF layout without loss.)
//
// Why: a kernel that keeps one output per vector (a dot product over the GGUF layout) sums its lanes at the end
// and, in bf16 or int8 dot products, rounds the activations or runs at half the rate of float32 FMAs (measured
// on an Intel Xeon: oneDNN bf16 GEMMs 85 GMAC/s on 2 cores, MKL float32 167). float32 FMAs on weights decoded
// once per panel are the faster way to multiply many rows (prefill chunks, large decode batches), and the
// weights are the file's exactly. Measured against such a kernel (vdpbf16ps on AVX-512, int16 on AVX2), see
// benchmarks/README.md: 1.3-2x at 1 to 256 rows with AVX-512, 1-2.7x with AVX2 (equal at one row), on an Intel Xeon.
// On an AMD Zen 4, whose float32 FMAs run at half the rate of its bfloat16 dot products, bf16_dot_linear.cpp (dot
// products on the integer codes, into float32 sums per block: no horizontal sums, nothing rounded) is 1.5-1.9x this
// kernel on q4, q4k, q6k and q8 blocks; EngineConfig.block_dot_products picks between them by measurement.
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

#include "block_formats.h"
#include "scratch.h"
#include "thread_pool.h"
#include "vec_math.h"

namespace {

using namespace serval_blocks;
constexpr bool dense(int f) { return f == kBF16 || f == kF32; }  // W^T rows of bfloat16 or float32 values

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
// Integer lanes: a vector's bytes zero-extended to 32 bits, masks and shifts of them, and their float32 values.
using Ints = __m512i;
inline Ints widen_bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(load_bytes(p)); }
inline Ints iset1(int v) { return _mm512_set1_epi32(v); }
inline Ints iand(Ints a, Ints b) { return _mm512_and_si512(a, b); }
inline Ints ior(Ints a, Ints b) { return _mm512_or_si512(a, b); }
inline Ints isrl(Ints a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline Ints isll(Ints a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline Vec ifloat(Ints a) { return _mm512_cvtepi32_ps(a); }
inline Vec load_bf16(const uint16_t* p) {  // bfloat16 bits are a float32's high half: exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store_out(float* y, Vec v, int count) { _mm512_mask_storeu_ps(y, serval::first_mask16(count), v); }
inline void store_out(uint16_t* y, Vec v, int count) { serval::store_bfloat16(y, v, count); }
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
using Ints = __m256i;
inline Ints widen_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(load_bytes(p)); }
inline Ints iset1(int v) { return _mm256_set1_epi32(v); }
inline Ints iand(Ints a, Ints b) { return _mm256_and_si256(a, b); }
inline Ints ior(Ints a, Ints b) { return _mm256_or_si256(a, b); }
inline Ints isrl(Ints a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline Ints isll(Ints a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline Vec ifloat(Ints a) { return _mm256_cvtepi32_ps(a); }
inline Vec load_bf16(const uint16_t* p) {  // bfloat16 bits are a float32's high half: exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
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


// Where a tile's two vectors of one block start: their bytes (one row of 16 bytes per input position, or per pair
// of them for the nibble formats), their scales (a row of 16 per scale: float16, float32, or the K formats' bytes)
// and, for the K formats, their super-block's float16 rows.
struct Panels {
  const uint8_t* packed;
  const uint8_t* scales;
  int64_t groups, block_bytes, block_scale_bytes, scale_size;  // per 16-column panel, of one block
  int64_t super_block_bytes, super_header_bytes;  // K formats: of a super-block's scales, and of its float16 rows
  // Dense formats: bytes from one input position's row of W^T to the next, of one weight, and K (the last block
  // of 32 may be short: rows past K are not read).
  int64_t row_bytes = 0, element_bytes = 0, depth = 0;

  void block(int64_t tile, int64_t g, const uint8_t* q[2], const uint8_t* s[2], const uint16_t* h[2]) const {
    for (int c = 0; c < 2; ++c) {
      const int64_t column = tile * kCols + c * kLanes;
      if (row_bytes) {  // dense: the block's first row of W^T, at the vector's first column; no scales
        q[c] = packed + g * kBlock * row_bytes + column * element_bytes;
        s[c] = nullptr;
        h[c] = nullptr;
        continue;
      }
      const int64_t index = (column / 16) * groups + g;
      q[c] = packed + index * block_bytes + column % 16;
      if (super_block_bytes) {
        const uint8_t* super = scales + (index / kSuperBlocks) * super_block_bytes;
        h[c] = reinterpret_cast<const uint16_t*>(super) + column % 16;
        s[c] = super + super_header_bytes + (g % kSuperBlocks) * block_scale_bytes + column % 16;
      } else {
        s[c] = scales + index * block_scale_bytes + (column % 16) * scale_size;
        h[c] = nullptr;
      }
    }
  }

};

// Asks for a tile's block g (its bytes, scales and super-block rows) while another computes. A tile reads four
// short streams (two panels' bytes and scales, a few KB each) that the hardware prefetcher takes several cache
// lines to find again at every tile; so at few rows each block of a tile asks for the same block of the next tile.
// (At many rows a tile's blocks are decoded in one burst, which the hardware follows: asking there measured 3-9%
// slower at 16 rows.) Always inlined: GCC 12 finds a function of prefetches alone free of side effects and deletes
// the calls to it.
template <int F>
__attribute__((always_inline)) inline void prefetch_block(const Panels& w, int64_t tile, int64_t g) {
  constexpr int bytes = block_rows(F) * 16;
  for (int p = 0; p < kCols / 16; ++p) {  // the tile's panels; addresses as Panels::block has them
    const int64_t index = (tile * (kCols / 16) + p) * w.groups + g;
    for (int b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w.packed + index * bytes + b), _MM_HINT_T0);
    if constexpr (k_scales(F)) {
      const uint8_t* super = w.scales + (index / kSuperBlocks) * super_bytes(F);
      const uint8_t* block = super + super_rows(F) * 32 + (g % kSuperBlocks) * scale_rows(F) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(block), _MM_HINT_T0);
      if (g % kSuperBlocks == 0) _mm_prefetch(reinterpret_cast<const char*>(super), _MM_HINT_T0);
    } else {
      constexpr int scale_bytes = scale_rows(F) * 16 * (half_scales(F) ? 2 : 4);
      for (int b = 0; b < scale_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + index * scale_bytes + b), _MM_HINT_T0);
    }
  }
}

// Row r of a block's scales as float32. K formats: the super-block's float16 row (d, or -dmin for r = 1; q6k: d)
// times the block's byte row r (sc, mn; q6k: sc of positions 0-15, of 16-31), exact in float32.
template <int F>
inline Vec load_scale(const uint8_t* s, const uint16_t* h, int row) {
  if constexpr (half_scales(F)) return load_halves(reinterpret_cast<const uint16_t*>(s) + row * 16);
  else if constexpr (F == kQ6K) return vmul(load_halves(h), signed_bytes(load_bytes(s + row * 16)));
  else if constexpr (k_scales(F)) return vmul(load_halves(h + row * 16), unsigned_bytes(load_bytes(s + row * 16)));
  else return vload(reinterpret_cast<const float*>(s) + row * 16);
}

// A block's scales per vector c and half of the block h (Q6_K's sub-blocks are 16 positions): w = d * q + m.
// q8: w = d * q (signed). q6f, q6k: scales (d of positions 0-15, d of 16-31), m = -32 d (exact: a power of two).
template <int F>
inline void block_scales(const uint8_t* const s[2], const uint16_t* const h[2], Vec d[2][2], Vec m[2][2]) {
  if constexpr (dense(F)) return;  // no scales
  for (int c = 0; c < 2; ++c) {
    if constexpr (sub_blocks_of_16(F)) {
      for (int half = 0; half < 2; ++half) {
        d[c][half] = load_scale<F>(s[c], h[c], half);
        m[c][half] = vmul(d[c][half], vset1(-32.f));
      }
    } else {
      d[c][0] = d[c][1] = load_scale<F>(s[c], h[c], 0);
      m[c][0] = m[c][1] = F == kQ8 ? vzero() : load_scale<F>(s[c], h[c], 1);
    }
  }
}

// Input positions 2 * pair and 2 * pair + 1 of one vector's columns, decoded to float32: the low and high nibble
// of the pair's byte row, with the bits above them from the bit-plane rows (5-bit: row 16 + k / 8 holds position
// k at bit k % 8; 6-bit: row 16 + k / 4 holds it at bits 2 (k % 4) and up). The bytes are widened to 32-bit lanes
// first: the nibbles are then a mask and a shift of one vector (5 vector instructions for both positions where
// masking bytes and widening each nibble took 7), the same integers.
template <int F>
inline void pair_weights(const uint8_t* q, int pair, Vec d, Vec m, Vec& even, Vec& odd) {
  const Ints b = widen_bytes(q + pair * 16);  // 0-255 per lane: the high nibble is b >> 4
  Ints lo = iand(b, iset1(15)), hi = isrl(b, 4);
  constexpr int e = extra_bits(F);
  if constexpr (e > 0) {
    constexpr int pairs_per_row = 4 / e;
    const Ints h = isrl(widen_bytes(q + (16 + pair / pairs_per_row) * 16), 2 * e * (pair % pairs_per_row));
    const Ints top = iset1(((1 << e) - 1) << 4);
    lo = ior(lo, iand(isll(h, 4), top));
    hi = ior(hi, iand(isll(h, 4 - e), top));
  }
  even = vfma(ifloat(lo), d, m);
  odd = vfma(ifloat(hi), d, m);
}

// Dense formats: one vector's columns of one row of W^T as float32; ``count`` of them lie inside the matrix (the
// last tile's lanes past N are zero and read nothing).
template <int F>
inline Vec dense_weights(const uint8_t* p, int64_t count) {
  alignas(64) uint8_t lanes[kLanes * 4];
  if (count < kLanes) {
    std::memset(lanes, 0, sizeof(lanes));
    if (count > 0) std::memcpy(lanes, p, count * (F == kF32 ? 4 : 2));
    p = lanes;
  }
  if constexpr (F == kF32) return vload(reinterpret_cast<const float*>(p));
  else return load_bf16(reinterpret_cast<const uint16_t*>(p));
}

// Dense formats: one block (up to 32 rows of W^T, fewer in the last) of a tile's columns as float32, out[k][0 ..
// kCols): the same loads as tiles_dense's, so the same floats. A tile's rows are a cache line or two each, a row of
// W^T apart, which the hardware does not prefetch: the next tile's are asked for here, while this one computes.
template <int F>
inline void decode_dense(const Panels& w, int64_t tile, int64_t g, int64_t N, float* out) {
  const uint8_t* q[2];
  const uint8_t* s[2];
  const uint16_t* h[2];
  w.block(tile, g, q, s, h);
  const int64_t rows = std::min<int64_t>(kBlock, w.depth - g * kBlock);
  for (int64_t k = 0; k < rows; ++k)
    for (int c = 0; c < 2; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(q[c] + k * w.row_bytes + kCols * w.element_bytes), _MM_HINT_T0);
      vstore(out + k * kCols + c * kLanes, dense_weights<F>(q[c] + k * w.row_bytes, N - tile * kCols - c * kLanes));
    }
}

// One block (32 input positions) of a tile's columns, decoded to float32: out[k][0 .. kCols). The same
// instructions as tile_inline's, so the same floats.
template <int F>
inline void decode_block(const uint8_t* const q[2], const uint8_t* const s[2], const uint16_t* const h[2],
                         float* out) {
  Vec d[2][2], m[2][2];
  block_scales<F>(s, h, d, m);
  for (int c = 0; c < 2; ++c) {
    if constexpr (F == kQ8) {
      for (int k = 0; k < kBlock; ++k)
        vstore(out + k * kCols + c * kLanes, vmul(signed_bytes(load_bytes(q[c] + k * 16)), d[c][0]));
    } else {
      for (int pair = 0; pair < 16; ++pair) {
        Vec even, odd;
        pair_weights<F>(q[c], pair, d[c][pair / 8], m[c][pair / 8], even, odd);
        vstore(out + (2 * pair) * kCols + c * kLanes, even);
        vstore(out + (2 * pair + 1) * kCols + c * kLanes, odd);
      }
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
// The tile ``ahead`` is prefetched block by block (the next tile of this thread's, or this one for its last).
template <int F, int R, typename Out>
void tile_inline(const Panels& w, int64_t tile, int64_t ahead, const float* x, int64_t ldx, Out* y, int64_t N) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    prefetch_block<F>(w, ahead, g);
    const uint8_t* q[2];
    const uint8_t* s[2];
    const uint16_t* h[2];
    w.block(tile, g, q, s, h);
    Vec d[2][2], m[2][2];
    block_scales<F>(s, h, d, m);
    const float* xg = x + g * kBlock;
    if constexpr (F == kQ8) {
      for (int k = 0; k < kBlock; ++k) {
        Vec wk[2];
        for (int c = 0; c < 2; ++c) wk[c] = vmul(signed_bytes(load_bytes(q[c] + k * 16)), d[c][0]);
        for (int r = 0; r < R; ++r) {
          const Vec xb = vset1(xg[r * ldx + k]);
          for (int c = 0; c < 2; ++c) acc[r][c] = vfma(xb, wk[c], acc[r][c]);
        }
      }
    } else {
      for (int pair = 0; pair < 16; ++pair) {
        Vec even[2], odd[2];
        for (int c = 0; c < 2; ++c) pair_weights<F>(q[c], pair, d[c][pair / 8], m[c][pair / 8], even[c], odd[c]);
        for (int r = 0; r < R; ++r) {
          const Vec xe = vset1(xg[r * ldx + 2 * pair]), xo = vset1(xg[r * ldx + 2 * pair + 1]);
          for (int c = 0; c < 2; ++c) acc[r][c] = vfma(xo, odd[c], vfma(xe, even[c], acc[r][c]));
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

template <int F, int R, typename Out>
void rows_inline(int64_t rows, const Panels& w, int64_t tile, int64_t ahead, const float* x, int64_t ldx, Out* y,
                 int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tile_inline<F, R, Out>(w, tile, ahead, x, ldx, y, N);
    rows_inline<F, R - 1, Out>(rows, w, tile, ahead, x, ldx, y, N);
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

// Dense formats, few rows: the tiles [t0, t1) over 16 input positions at a time, each tile's sums kept in memory
// between them (stored and reloaded exactly: each output is the same FMA chain over k in order as in the buffered
// path, so the same bits). Each row of W^T is then read along its columns, which the hardware prefetches; a tile
// walking down its column of rows (a cache line in each, a row apart) ran at half the bandwidth at 3072 columns.
constexpr int64_t kDenseChunk = 16;
// Rows a pass: one under the block formats' tile (measured with AVX-512: 8 rows ran at 1.8x the time of 7, where 7
// took 1.1x the time of 6), and passes of them up to kDenseStreamedRows, past which decoding a tile's rows once
// into the buffer for all rows pays.
constexpr int kDenseRows = kTileRows - 1;
constexpr int64_t kDenseStreamedRows = 3 * kDenseRows;
template <int F, int R, typename Out>
void tiles_dense(const Panels& w, int64_t t0, int64_t t1, const float* x, int64_t ldx, Out* y, int64_t N) {
  float* sums = serval::scratch(2, (t1 - t0) * R * kCols);  // slots 0 and 1 are the buffered path's and x's
  const int64_t K = w.depth;
  for (int64_t k0 = 0; k0 < K; k0 += kDenseChunk) {
    const int64_t k1 = std::min(K, k0 + kDenseChunk);
    for (int64_t t = t0; t < t1; ++t) {
      float* sum = sums + (t - t0) * R * kCols;
      Vec acc[R][2];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) acc[r][c] = k0 == 0 ? vzero() : vload(sum + r * kCols + c * kLanes);
      const uint8_t* q = w.packed + t * kCols * w.element_bytes;
      for (int64_t k = k0; k < k1; ++k) {
        Vec wk[2];
        for (int c = 0; c < 2; ++c)
          wk[c] = dense_weights<F>(q + k * w.row_bytes + c * kLanes * w.element_bytes, N - t * kCols - c * kLanes);
        for (int r = 0; r < R; ++r) {
          const Vec xb = vset1(x[r * ldx + k]);
          for (int c = 0; c < 2; ++c) acc[r][c] = vfma(xb, wk[c], acc[r][c]);
        }
      }
      if (k1 < K) {
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < 2; ++c) vstore(sum + r * kCols + c * kLanes, acc[r][c]);
      } else {
        store<R, Out>(acc, y, N, t * kCols);
      }
    }
  }
}

template <int F, int R, typename Out>
void rows_dense(int64_t rows, const Panels& w, int64_t t0, int64_t t1, const float* x, int64_t ldx, Out* y,
                int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tiles_dense<F, R, Out>(w, t0, t1, x, ldx, y, N);
    rows_dense<F, R - 1, Out>(rows, w, t0, t1, x, ldx, y, N);
  }
}

template <int F, typename Out>
void gemm_panels(const float* x, int64_t M, int64_t K, const Panels& w, int64_t N, Out* y) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  serval::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if constexpr (dense(F)) {
      if (M <= kDenseStreamedRows) {
        for (int64_t r0 = 0; r0 < M; r0 += kDenseRows)
          rows_dense<F, kDenseRows, Out>(std::min<int64_t>(kDenseRows, M - r0), w, begin, end, x + r0 * K, K,
                                         y + r0 * N, N);
        return;
      }
    } else if (M <= kTileRows) {
      for (int64_t t = begin; t < end; ++t)
        rows_inline<F, kTileRows, Out>(M, w, t, std::min(t + 1, end - 1), x, K, y, N);
      return;
    }
    // Many rows: the tile's weights are decoded once for all of them.
    float* panel = serval::scratch(0, K * kCols);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < w.groups; ++g) {
        if constexpr (dense(F)) {
          decode_dense<F>(w, t, g, N, panel + g * kBlock * kCols);
          continue;
        }
        const uint8_t* q[2];
        const uint8_t* s[2];
        const uint16_t* h[2];
        w.block(t, g, q, s, h);
        decode_block<F>(q, s, h, panel + g * kBlock * kCols);
      }
      int64_t r0 = 0;
      for (; r0 + kTileRows <= M; r0 += kTileRows)
        tile_buffered<kTileRows, Out>(panel, K, x + r0 * K, K, y + r0 * N, N, t * kCols);
      rows_buffered<kTileRows - 1, Out>(M - r0, panel, K, x + r0 * K, K, y + r0 * N, N, t * kCols);
    }
  });
}

template <typename Out>
void gemm_format(int format, const float* x, int64_t M, int64_t K, const Panels& w, int64_t N, Out* y) {
  switch (format) {
    case kQ8: return gemm_panels<kQ8, Out>(x, M, K, w, N, y);
    case kQ4: return gemm_panels<kQ4, Out>(x, M, K, w, N, y);
    case kQ5: return gemm_panels<kQ5, Out>(x, M, K, w, N, y);
    case kQ4F: return gemm_panels<kQ4F, Out>(x, M, K, w, N, y);
    case kQ5F: return gemm_panels<kQ5F, Out>(x, M, K, w, N, y);
    case kQ6F: return gemm_panels<kQ6F, Out>(x, M, K, w, N, y);
    case kQ4K: return gemm_panels<kQ4K, Out>(x, M, K, w, N, y);
    case kQ5K: return gemm_panels<kQ5K, Out>(x, M, K, w, N, y);
    default: return gemm_panels<kQ6K, Out>(x, M, K, w, N, y);
  }
}

// x [M, K] as float32 rows (in per-thread scratch slot 1: slot 0 is the panels').
inline float* float_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  float* xf = serval::scratch(1, M * K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "float_rows", [&] {
    const at::Tensor xc = x.contiguous();
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(src[i]);
  });
  return xf;
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

// x [M, K] (float32 or bfloat16); panels uint8 [P, G, rows, 16] (rows: 32 for q8, 16 for q4, q4f and q4k, 20 for
// q5, q5f and q5k, 24 for q6f and q6k), scales [P, G, 2 (1 for q8), 16], float16 for q8, q4 and q5, float32 for
// q4f, q5f and q6f; for q4k and q5k uint8 [P, G / 8, 320], for q6k [P, G / 8, 288] (G a multiple of 8); P * 16
// >= N, P even and G * 32 >= K. Returns y [M, N] in x's dtype, or in float32 with float_output (logits: rounding them
// to bfloat16 would tie tokens whose scores differ by less than 1/8 at magnitude 16).
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                              const std::string& format, int64_t out_features, bool float_output) {
  const BlockCall call = check_block_call(x, panels, scales, format, out_features);
  const int f = call.format;
  const int64_t M = call.rows, K = call.in_features, N = call.out_features, groups = call.groups;
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
  const int64_t scale_size = scales.element_size();
  const Panels w{panels.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.data_ptr()), groups,
                 block_rows(f) * 16, scale_rows(f) * 16 * scale_size, scale_size,
                 k_scales(f) ? super_bytes(f) : 0, super_rows(f) * 32};
  if (x.scalar_type() == at::kBFloat16 && !float_output) {
    at::Tensor y = at::empty({M, N}, x.options());
    gemm_format(f, xf, M, padded, w, N, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_format(f, xf, M, padded, w, N, y.data_ptr<float>());
  return float_output ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "block_panel_linear needs AVX2 with FMA and F16C, or AVX-512 (check block_panel_kernel_available())");
#endif
}

// Rows of a weight in panels (block_panel_linear's panels and scales), dequantized to float32 [R, in_features]:
// row ``rows[r]`` of W, as decode_block gives the weights to the kernel, so the values of BlockWeight.dequantize
// (one rounding each; tests/layers/test_block_quant_linear.py). An embedding's lookup (layers/embedding.py): each
// row's blocks are decoded with their tile's other columns and only its own kept, some microseconds a row where
// the same done by PyTorch ops took half a millisecond for one token.
at::Tensor block_panel_rows(const at::Tensor& panels, const at::Tensor& scales, const std::string& format,
                            const at::Tensor& rows, int64_t in_features) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: int64 [R]");
  const at::Tensor ids = rows.contiguous();
  const int64_t R = ids.size(0), height = panels.size(0) * 16;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < height, "row ", id[r], " is not in the panels");
  const BlockCall call = check_block_call(at::empty({0, in_features}), panels, scales, format, height);
  const int f = call.format;
  at::Tensor out = at::empty({R, in_features}, at::kFloat);
#if defined(SERVAL_PANEL_KERNEL)
  TORCH_CHECK(!dense(f), "block_panel_rows reads block formats");
  const int64_t scale_size = scales.element_size(), groups = call.groups;
  const Panels w{panels.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.data_ptr()), groups,
                 block_rows(f) * 16, scale_rows(f) * 16 * scale_size, scale_size,
                 k_scales(f) ? super_bytes(f) : 0, super_rows(f) * 32};
  float* y = out.data_ptr<float>();
  auto decode = [&](auto format) {
    constexpr int F = decltype(format)::value;
    serval::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      alignas(64) float block[kBlock * kCols];
      for (int64_t r = begin; r < end; ++r) {
        const int64_t tile = id[r] / kCols, column = id[r] % kCols;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* q[2];
          const uint8_t* s[2];
          const uint16_t* h[2];
          w.block(tile, g, q, s, h);
          decode_block<F>(q, s, h, block);
          for (int64_t k = 0; k < kBlock && g * kBlock + k < in_features; ++k)
            y[r * in_features + g * kBlock + k] = block[k * kCols + column];
        }
      }
    });
  };
  switch (f) {
    case kQ8: decode(std::integral_constant<int, kQ8>()); break;
    case kQ4: decode(std::integral_constant<int, kQ4>()); break;
    case kQ5: decode(std::integral_constant<int, kQ5>()); break;
    case kQ4F: decode(std::integral_constant<int, kQ4F>()); break;
    case kQ5F: decode(std::integral_constant<int, kQ5F>()); break;
    case kQ6F: decode(std::integral_constant<int, kQ6F>()); break;
    case kQ4K: decode(std::integral_constant<int, kQ4K>()); break;
    case kQ5K: decode(std::integral_constant<int, kQ5K>()); break;
    default: decode(std::integral_constant<int, kQ6K>()); break;
  }
  return out;
#else
  TORCH_CHECK(false, "block_panel_rows needs AVX2 with FMA and F16C, or AVX-512 (check block_panel_kernel_available())");
#endif
}

// x [M, K] (float32 or bfloat16) times a dense weight given as weight_t = W^T [K, N], contiguous, bfloat16 or
// float32 (Linear's weight laid out for this kernel: layers/linear.py). Each output is one float32 FMA chain over k
// in order, as the block formats': no row padding. Returns y [M, N] in x's dtype, or float32 with float_output.
at::Tensor dense_panel_linear(const at::Tensor& x, const at::Tensor& weight_t, bool float_output) {
  TORCH_CHECK(x.dim() == 2 && weight_t.dim() == 2 && x.size(1) == weight_t.size(0), "x [M, K] and W^T [K, N]");
  TORCH_CHECK(weight_t.is_contiguous() &&
                  (weight_t.scalar_type() == at::kBFloat16 || weight_t.scalar_type() == at::kFloat),
              "W^T: contiguous bfloat16 or float32");
#if defined(SERVAL_PANEL_KERNEL)
  const int64_t M = x.size(0), K = x.size(1), N = weight_t.size(1);
  const int format = weight_t.scalar_type() == at::kFloat ? kF32 : kBF16;
  Panels w{};
  w.packed = static_cast<const uint8_t*>(weight_t.data_ptr());
  w.groups = (K + kBlock - 1) / kBlock;
  w.element_bytes = weight_t.element_size();
  w.row_bytes = N * w.element_bytes;
  w.depth = K;
  const float* xf = float_rows(x);
  auto run = [&](auto* y) {
    if (format == kF32) gemm_panels<kF32>(xf, M, K, w, N, y);
    else gemm_panels<kBF16>(xf, M, K, w, N, y);
  };
  if (x.scalar_type() == at::kBFloat16 && !float_output) {
    at::Tensor y = at::empty({M, N}, x.options());
    run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  run(y.data_ptr<float>());
  return float_output ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "dense_panel_linear needs AVX2 with FMA and F16C, or AVX-512 (check block_panel_kernel_available())");
#endif
}
