// y = x W^T for the block weights of panel_linear.cpp (the same panel bytes and scales), with the activations
// quantized to int8 per row and block of 32 inputs and multiplied by integer dot products: 4 multiply-adds per
// 32-bit lane and instruction (vpdpbusd with VNNI; vpmaddubsw + vpmaddwd with AVX2) instead of one float32 FMA.
// EngineConfig.activation_quantization "int8" picks it; it changes the numerics (see benchmarks/README.md).
//
// Per row and block b of 32 inputs (x padded with zeros to the blocks' width):
//   dx[b] = amax|x| / 127 (float32), xq = round-to-nearest-even(x / dx) in int8 (0 where dx = 0),
//   sx[b] = sum of xq (q6k, q6f: of positions 0-15 and of 16-31).
// Output n, over the blocks in order, acc starting at 0 (every step float32, fma rounding once):
//   q8:             acc = fma(d dx, float(sum q xq), acc)                      (q signed)
//   q4, q5, q4k, q5k, q4f, q5f (w = d q + m):
//                   acc = fma(d dx, float(sum q xq), acc); acc = fma(m, dx float(sx), acc)
//   q6k, q6f (w = d_h (q - 32), h the half of the block):
//                   acc = fma(d_h dx, float(sum_h q xq - 32 sx_h), acc) for h = 0, 1
// The sums are integers, exact in any order; so a row's bits depend on its own values only (not on the number of
// rows, the tile or the thread), and the AVX2 build gives the bits of the VNNI one.
//
// Layout: a block's panel bytes are rows of 16 columns (panel_linear.cpp). 64 bytes (4 rows) are regrouped so that
// each 32-bit lane holds one column's 4 bytes of those rows (vpermb with AVX-512 VBMI; with AVX2 a vpermq, a
// vpshufb and a vpunpck*wd, which leave the columns in the order 0-3, 8-11 | 4-7, 12-15, kept up to the store).
// From such a group, masks and shifts take the low nibbles (positions 2p), the high nibbles (2p + 1) or the extra
// bits (times 16, so they add to the nibbles' sum); each is dotted with a 32-bit word of the 4 activation bytes in
// the matching positions, arranged once per row (a "step", see step_position).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "block_formats.h"
#include "scratch.h"
#include "thread_pool.h"

namespace {

using namespace serval_blocks;

// Dot-product steps per block: q8 one per group of 4 rows (8); the nibble formats a low and a high one per group of
// 4 pair rows (8), plus 8 for the fifth bit (one group of 4 rows, bit b) or for the two sixth bits (two groups of 4
// rows, bits 2t).
constexpr int steps(int f) { return f == kQ8 ? 8 : 8 + 8 * (extra_bits(f) > 0); }

// The input position (0-31) whose activation byte s (0-3) of step i multiplies: byte s of a lane is the column's
// byte in row 4 L + s of the step's group L.
constexpr int step_position(int f, int i, int s) {
  if (f == kQ8) return 4 * i + s;
  if (i < 8) return 2 * (4 * (i / 2) + s) + i % 2;  // pair row 4 L + s: low nibble 2p, high 2p + 1
  const int j = i - 8;
  if (extra_bits(f) == 1) return 8 * s + j;  // row 16 + s holds positions 8 s .. 8 s + 7 at bits 0-7
  return 16 * (j / 4) + 4 * s + j % 4;       // row 16 + r holds positions 4 r .. 4 r + 3 at bits 0-1, ..., 6-7
}

// A row's quantized block: its scale dx, dx times the sum of its codes (formats with a min), and the halves' sums.
struct BlockActivations {
  float dx, dx_sum;
  int32_t sum[2];
};

// Byte 4 i + s of a block's step words is its code at step_position(F, i, s) (4 steps(F) <= 64 bytes; the rest 0).
template <int F>
constexpr std::array<uint8_t, 64> step_bytes() {
  std::array<uint8_t, 64> index{};
  for (int i = 0; i < steps(F); ++i)
    for (int s = 0; s < 4; ++s) index[4 * i + s] = static_cast<uint8_t>(step_position(F, i, s));
  return index;
}

#if defined(__AVX512VBMI__)

// A block's 32 codes (int32) as bytes (truncated, as static_cast does): their halves' sums and the step words, in
// vectors (at 256 rows the scalar loop took about a tenth of a call's time).
template <int F>
inline void arrange_codes(const int32_t* codes, int32_t sum[2], int32_t* words) {
  const __m128i low = _mm512_cvtepi32_epi8(_mm512_loadu_si512(codes));
  const __m128i high = _mm512_cvtepi32_epi8(_mm512_loadu_si512(codes + 16));
  sum[0] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(low));
  sum[1] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(high));
  static constexpr std::array<uint8_t, 64> index = step_bytes<F>();
  const __m512i q = _mm512_zextsi256_si512(_mm256_set_m128i(high, low));
  const __m512i bytes = _mm512_permutexvar_epi8(_mm512_loadu_si512(index.data()), q);
  _mm512_mask_storeu_epi8(words, steps(F) == 16 ? ~0ull : (1ull << (4 * steps(F))) - 1, bytes);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512VBMI__)
// arrange_codes with AVX2. Its scalar loop took 43 of a 74-microsecond one-row call on a q6k linear of 8192 inputs
// (an AMD EPYC Zen 3): a vpshufb takes each code's low byte (truncated, as static_cast does), and two more, one per
// 16-byte half of the codes, blended, place them in the steps' order.
template <int F>
inline void arrange_codes(const int32_t* codes, int32_t sum[2], int32_t* words) {
  const __m256i low_byte = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)  // lane 0's first word: codes 8 i .. 8 i + 3; lane 1's: 8 i + 4 .. 8 i + 7
    c[i] = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 8 * i)), low_byte);
  const __m256i mixed = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(c[0], c[1]), _mm256_unpacklo_epi32(c[2], c[3]));
  const __m256i q = _mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // codes 0-31
  // Each half's sum: the bytes plus 128 (unsigned) summed by vpsadbw, less 16 * 128.
  const __m256i totals = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
  alignas(32) int64_t quarter[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(quarter), totals);
  sum[0] = static_cast<int32_t>(quarter[0] + quarter[1]) - 16 * 128;
  sum[1] = static_cast<int32_t>(quarter[2] + quarter[3]) - 16 * 128;
  static constexpr std::array<uint8_t, 64> index = step_bytes<F>();
  const __m256i first = _mm256_permute2x128_si256(q, q, 0x00), second = _mm256_permute2x128_si256(q, q, 0x11);
  for (int half = 0; half < steps(F) / 8; ++half) {
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index.data() + 32 * half));
    const __m256i from_second = _mm256_slli_epi16(at, 3);  // bit 4 of a byte (index >= 16) to its top bit
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + 8 * half),
                        _mm256_blendv_epi8(_mm256_shuffle_epi8(first, at), _mm256_shuffle_epi8(second, at),
                                           from_second));
  }
}
#endif

#if defined(__AVX2__)
// x [M, K] (float32) → per row and block: steps(f) words of 4 activation bytes, and the block's scales and sums.
// In vectors of 8 (both builds): x / dx is correctly rounded in any width, and the conversion to int32 rounds by the
// default mode, to nearest even, as nearbyint does; amax skips NaN as std::max(amax, |v|) did.
template <int F>
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t groups, int32_t* words, BlockActivations* blocks) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t k0 = g * kBlock + 8 * i;
        if (k0 + 8 <= K) {
          v[i] = _mm256_loadu_ps(x + r * K + k0);
        } else {  // past K: zeros
          alignas(32) float lanes[8] = {};
          for (int64_t k = k0; k < K; ++k) lanes[k - k0] = x[r * K + k];
          v[i] = _mm256_load_ps(lanes);
        }
      }
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 top = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) top = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), top);  // NaN lanes keep top
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      float amax = 0.f;
      for (int k = 0; k < 8; ++k) amax = std::max(amax, lanes[k]);
      const float dx = amax / 127.f;
      alignas(32) int32_t codes[kBlock] = {};
      if (dx != 0.f) {
        const __m256 step = _mm256_set1_ps(dx);
        for (int i = 0; i < 4; ++i)
          _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), _mm256_cvtps_epi32(_mm256_div_ps(v[i], step)));
      }
      int32_t sum[2] = {0, 0};
      int32_t* w = words + (r * groups + g) * steps(F);
      arrange_codes<F>(codes, sum, w);
      BlockActivations& b = blocks[r * groups + g];
      b.dx = dx;
      b.dx_sum = dx * static_cast<float>(sum[0] + sum[1]);
      b.sum[0] = sum[0], b.sum[1] = sum[1];
    }
  }
}

// float32 to bfloat16 bits, rounding to nearest even as c10::BFloat16 does (NaN to its quiet NaN), 8 at a time.
inline void to_bfloat16(const float* y, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                   _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                                                   _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i high = _mm256_srli_epi32(rounded, 16);  // < 2^16: packing without saturation
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
  }
  for (; i < n; ++i) out[i] = c10::BFloat16(y[i]).x;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define SERVAL_INT8_KERNEL 512
// A group: 16 columns' 4 bytes, one column per 32-bit lane, columns in order. F16: their 16 float32 values.
using Group = __m512i;
using Ints = __m512i;
using F16 = __m512;
constexpr int kTileRows = 6;
// Independent integer sums a block's dot products are spread over, at 1 and 2 rows (one chain of 8 to 16 dependent
// vpdpbusd per sum otherwise; the integers are the same in any order).
constexpr int chains(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
inline Group load_group(const uint8_t* p) {
  // byte 4 j + s of the result is byte 16 s + j of the 4 rows: column j's byte of row s
  const __m512i index = _mm512_set_epi8(
      63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26, 10,
      57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
      51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
  return _mm512_permutexvar_epi8(index, _mm512_loadu_si512(p));
}
inline Group mask(Group v, int m) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(m))); }
inline Group shift_left(Group v, int n) { return _mm512_slli_epi16(v, n); }
inline Group shift_right(Group v, int n) { return _mm512_srli_epi16(v, n); }
inline Ints int_zero() { return _mm512_setzero_si512(); }
// acc + per lane the sum of its 4 unsigned bytes of w times the 4 signed bytes of word
inline Ints dot(Ints acc, Group w, int32_t word) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(word)); }
// The same with signed bytes w, offset: w + 128 (w with its top bit flipped) as unsigned; the caller subtracts
// 128 times the sum of the activation bytes (offset_signed_dot).
constexpr bool offset_signed_dot = true;
inline Ints dot_signed(Ints acc, Group w, int32_t word) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))),
                             _mm512_set1_epi32(word));
}
inline Ints sub_times(Ints a, int32_t times, int32_t b) {
  return _mm512_sub_epi32(a, _mm512_set1_epi32(times * b));
}
inline Ints int_add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline F16 to_float(Ints a) { return _mm512_cvtepi32_ps(a); }
inline F16 fzero() { return _mm512_setzero_ps(); }
inline F16 fset1(float v) { return _mm512_set1_ps(v); }
inline F16 fmul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 ffma(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }
inline F16 load_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline F16 load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline F16 load_unsigned_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F16 load_signed_bytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_out(float* y, F16 v, int count) {
  _mm512_mask_storeu_ps(y, count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1), v);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVAL_INT8_KERNEL 256
// A group in two vectors: columns 0-3, 8-11 and 4-7, 12-15 (what in-lane unpacking gives); F16 the same order.
struct Group {
  __m256i a, b;
};
using Ints = Group;
struct F16 {
  __m256 a, b;
};
// Rows a pass over a panel's blocks, each block's bytes regrouped once for them: 4, though their sums and
// accumulators outgrow the 16 registers (the accumulators, touched once a block, go to the stack), measured 1-10%
// faster at 16 rows and 6-14% at 4 than 2 rows a pass on an AMD EPYC Zen 2 (benchmarks/README.md). Without VNNI
// the nibble formats take panel_rows_prepared from 4 rows, panel_rows below that (4-bit and q6 blocks with int16
// sums, int16_block).
constexpr int kTileRows = 4;
constexpr int chains(int rows) { return rows == 1 ? 2 : 1; }  // 16 registers: two sums of two each at one row
inline Group load_group(const uint8_t* p) {
  // rows 0, 1 and 2, 3 as [row0 c0-7, row1 c0-7 | row0 c8-15, row1 c8-15], then each lane's two rows interleaved
  // bytewise, then the two pairs of rows interleaved by 16 bits: a lane per column.
  const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m256i r01 = _mm256_shuffle_epi8(
      _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8), order);
  const __m256i r23 = _mm256_shuffle_epi8(
      _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 0xD8), order);
  return {_mm256_unpacklo_epi16(r01, r23), _mm256_unpackhi_epi16(r01, r23)};
}
inline Group mask(Group v, int m) {
  const __m256i k = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_and_si256(v.a, k), _mm256_and_si256(v.b, k)};
}
inline Group shift_left(Group v, int n) { return {_mm256_slli_epi16(v.a, n), _mm256_slli_epi16(v.b, n)}; }
inline Group shift_right(Group v, int n) { return {_mm256_srli_epi16(v.a, n), _mm256_srli_epi16(v.b, n)}; }
inline Ints int_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  // pairs of u8 x s8 products summed to int16 (at most 2 * 128 * 127: no saturation), then pairs of those to int32
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
inline Ints dot(Ints acc, Group w, int32_t word) {
  const __m256i x = _mm256_set1_epi32(word);
  return {dot8(acc.a, w.a, x), dot8(acc.b, w.b, x)};
}
#if !defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
// Without VNNI a step is vpmaddubsw, vpmaddwd and vpaddd, and the two multiplies share one port (Zen 2). The
// nibble formats' codes are small, so a block's pair products are summed in int16 and widened once
// (panel_rows_prepared): the same integers with about half the multiplies.
#define SERVAL_INT8_INT16_SUMS
using Sums16 = Group;
inline Sums16 dot16(Sums16 acc, Group w, int32_t word) {  // pairs of u8 x s8 products added in int16
  const __m256i x = _mm256_set1_epi32(word);
  return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(w.a, x)),
          _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(w.b, x))};
}
inline Ints widen(Sums16 v, int16_t times) {  // times the int16 sums' pairs, added to int32
  const __m256i k = _mm256_set1_epi16(times);
  return {_mm256_madd_epi16(v.a, k), _mm256_madd_epi16(v.b, k)};
}
#endif
// The same with signed bytes w: |w| times the word's bytes with w's signs (|w| <= 128, |x| <= 127: vpmaddubsw's
// pairs stay under 2^15).
constexpr bool offset_signed_dot = false;
inline Ints dot_signed(Ints acc, Group w, int32_t word) {
  const __m256i x = _mm256_set1_epi32(word);
  return {dot8(acc.a, _mm256_abs_epi8(w.a), _mm256_sign_epi8(x, w.a)),
          dot8(acc.b, _mm256_abs_epi8(w.b), _mm256_sign_epi8(x, w.b))};
}
inline Ints sub_times(Ints v, int32_t times, int32_t b) {
  const __m256i k = _mm256_set1_epi32(times * b);
  return {_mm256_sub_epi32(v.a, k), _mm256_sub_epi32(v.b, k)};
}
inline Ints int_add(Ints x, Ints y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline F16 to_float(Ints v) { return {_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F16 fmul(F16 x, F16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F16 ffma(F16 x, F16 y, F16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
// Columns 0-7, 8-15 → 0-3, 8-11 | 4-7, 12-15; the same shuffle takes them back.
inline F16 regroup(__m256 lo, __m256 hi) {
  return {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
}
inline F16 load_halves(const uint16_t* p) {
  return regroup(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                 _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
}
inline F16 load_floats(const float* p) { return regroup(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
inline F16 load_unsigned_bytes(const uint8_t* p) {
  return regroup(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))));
}
inline F16 load_signed_bytes(const uint8_t* p) {
  return regroup(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))));
}
inline void store_out(float* y, F16 v, int count) {
  const F16 natural = regroup(v.a, v.b);
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, natural.a);
  _mm256_store_ps(lanes + 8, natural.b);
  std::memcpy(y, lanes, std::min(count, 16) * sizeof(float));
}
#endif

#if defined(SERVAL_INT8_KERNEL)
// Where a 16-column panel's blocks and scales are (panel_linear.cpp's layout).
struct Panels {
  const uint8_t* packed;
  const uint8_t* scales;
  int64_t groups;
};

// A block's scales of the panel's 16 columns: d and m (w = d q + m; q8: m unused), or q6's d of each half.
template <int F>
inline void block_scales(const Panels& w, int64_t panel, int64_t g, F16& d0, F16& d1) {
  const int64_t index = panel * w.groups + g;
  if constexpr (k_scales(F)) {
    const uint8_t* super = w.scales + (index / kSuperBlocks) * super_bytes(F);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(super);
    const uint8_t* s = super + super_rows(F) * 32 + (g % kSuperBlocks) * scale_rows(F) * 16;
    if constexpr (F == kQ6K) {
      const F16 d = load_halves(h);
      d0 = fmul(d, load_signed_bytes(s));
      d1 = fmul(d, load_signed_bytes(s + 16));
    } else {
      d0 = fmul(load_halves(h), load_unsigned_bytes(s));
      d1 = fmul(load_halves(h + 16), load_unsigned_bytes(s + 16));
    }
  } else if constexpr (half_scales(F)) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(w.scales) + index * scale_rows(F) * 16;
    d0 = load_halves(s);
    d1 = F == kQ8 ? fzero() : load_halves(s + 16);
  } else {
    const float* s = reinterpret_cast<const float*>(w.scales) + index * 32;
    d0 = load_floats(s);
    d1 = load_floats(s + 16);
  }
}

// acc plus a block's terms: its integer sums (sums[1]: the second half's, q6) times the scales, as the header says.
template <int F>
inline F16 add_block(F16 acc, const Ints sums[2], F16 d0, F16 d1, const BlockActivations& b) {
  const F16 dx = fset1(b.dx);
  if constexpr (sub_blocks_of_16(F)) {
    acc = ffma(fmul(d0, dx), to_float(sub_times(sums[0], 32, b.sum[0])), acc);
    return ffma(fmul(d1, dx), to_float(sub_times(sums[1], 32, b.sum[1])), acc);
  } else {
    Ints sum = sums[0];
    if constexpr (F == kQ8 && offset_signed_dot) sum = sub_times(sum, 128, b.sum[0] + b.sum[1]);
    acc = ffma(fmul(d0, dx), to_float(sum), acc);
    if constexpr (F != kQ8) acc = ffma(d1, fset1(b.dx_sum), acc);
    return acc;
  }
}

// Bytes ahead of the block being read that a pass asks the caches for. The panels are read in memory order, one
// stream per thread, yet without asking a one-row pass of the 1B's linears read 10-15 GB/s on an AMD EPYC Zen 3 with
// two threads (a stream read: 16-22): each block's arithmetic waited for its bytes. 2 KiB ahead (5-8 blocks) measured
// 15-22% faster there, 1 KiB less, 3-6 KiB the same; the scales' smaller stream gained nothing (benchmarks/README.md).
constexpr int64_t kPrefetchBytes = 2048;

template <int F>
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* block) {
  for (int i = 0; i < block_rows(F) * 16; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + i), _MM_HINT_T0);
}

#if defined(SERVAL_INT8_INT16_SUMS)
// panel_rows's integer sums of a 4-bit or q6 block, at fewer rows than panel_rows_prepared takes, with the pair
// products added in int16 and widened once (vpmaddubsw and vpaddw a step instead of vpmaddubsw, vpmaddwd and vpaddd).
// A pair is at most 2 * 15 * 128 = 3,840 (nibbles) or 2 * 48 * 128 = 12,288 (q6's two high bits, times 16), so int16
// holds the sum of 8 nibble steps (a 4-bit block), of 4 (a q6 half), or of 2 bit steps: the same integers.
template <int F, int R>
[[gnu::always_inline]] inline void int16_block(const uint8_t* q, const int32_t* const* x, Ints (&part)[R][2][chains(R)]) {
  static_assert(extra_bits(F) != 1);
  constexpr int H = extra_bits(F) == 2 ? 2 : 1;  // q6: each half (positions 0-15, 16-31) summed on its own
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
    Sums16 nibbles[R];
    for (int r = 0; r < R; ++r) nibbles[r] = int_zero();
#pragma GCC unroll 4
    for (int L = 4 / H * h; L < 4 / H * (h + 1); ++L) {
      const Group v = load_group(q + 64 * L);
      const Group lo = mask(v, 0x0F), hi = mask(shift_right(v, 4), 0x0F);
      for (int r = 0; r < R; ++r) nibbles[r] = dot16(dot16(nibbles[r], lo, x[r][2 * L]), hi, x[r][2 * L + 1]);
    }
    for (int r = 0; r < R; ++r) part[r][h][0] = widen(nibbles[r], 1);
    if constexpr (extra_bits(F) == 2) {  // bits 2t, 2t + 1 of rows 16 + 4 h + s, times 16, two steps a sum
      const Group v = load_group(q + 256 + 64 * h);
#pragma GCC unroll 2
      for (int t = 0; t < 4; t += 2) {
        const Group b0 = mask(t < 2 ? shift_left(v, 4 - 2 * t) : shift_right(v, 2 * t - 4), 0x30);
        const Group b1 = mask(t + 1 < 2 ? shift_left(v, 4 - 2 * (t + 1)) : shift_right(v, 2 * (t + 1) - 4), 0x30);
        for (int r = 0; r < R; ++r)
          part[r][h][0] = int_add(part[r][h][0], widen(dot16(dot16(int_zero(), b0, x[r][8 + 4 * h + t]), b1,
                                                             x[r][8 + 4 * h + t + 1]), 1));
      }
    }
  }
}
#endif

// R rows (words, blocks: theirs, row after row) times one 16-column panel, into y (row stride N). At few rows a
// block's dot products go to C independent sums per row and half, added at the end.
template <int F, int R>
void panel_rows(const Panels& w, int64_t panel, const int32_t* words, const BlockActivations* blocks, float* y,
                int64_t N) {
  constexpr int S = steps(F), C = chains(R);
  const int64_t G = w.groups;
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* q = w.packed + (panel * G + g) * block_rows(F) * 16;
    prefetch_ahead<F>(q);
    Ints part[R][2][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) part[r][0][c] = part[r][1][c] = int_zero();
    const int32_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = words + (r * G + g) * S;
    if constexpr (F == kQ8) {
#pragma GCC unroll 8
      for (int L = 0; L < 8; ++L) {
        const Group v = load_group(q + 64 * L);
        for (int r = 0; r < R; ++r) part[r][0][L % C] = dot_signed(part[r][0][L % C], v, x[r][L]);
      }
#if defined(SERVAL_INT8_INT16_SUMS)
    } else if constexpr (extra_bits(F) != 1) {
      int16_block<F, R>(q, x, part);
#endif
    } else {
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const Group v = load_group(q + 64 * L);
        const Group lo = mask(v, 0x0F), hi = mask(shift_right(v, 4), 0x0F);
        const int h = sub_blocks_of_16(F) ? L / 2 : 0;
        for (int r = 0; r < R; ++r) {
          part[r][h][(2 * L) % C] = dot(part[r][h][(2 * L) % C], lo, x[r][2 * L]);
          part[r][h][(2 * L + 1) % C] = dot(part[r][h][(2 * L + 1) % C], hi, x[r][2 * L + 1]);
        }
      }
      if constexpr (extra_bits(F) == 1) {  // bit b of row 16 + s, times 16
        const Group v = load_group(q + 256);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const Group bit = mask(b < 4 ? shift_left(v, 4 - b) : shift_right(v, b - 4), 0x10);
          for (int r = 0; r < R; ++r) part[r][0][b % C] = dot(part[r][0][b % C], bit, x[r][8 + b]);
        }
      } else if constexpr (extra_bits(F) == 2) {  // bits 2t, 2t + 1 of rows 16 + 4 h + s, times 16
        for (int h = 0; h < 2; ++h) {
          const Group v = load_group(q + 256 + 64 * h);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) {
            const Group bits = mask(t < 2 ? shift_left(v, 4 - 2 * t) : shift_right(v, 2 * t - 4), 0x30);
            for (int r = 0; r < R; ++r) part[r][h][t % C] = dot(part[r][h][t % C], bits, x[r][8 + 4 * h + t]);
          }
        }
      }
    }
    Ints sums[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        sums[r][h] = part[r][h][0];
        for (int c = 1; c < C; ++c) sums[r][h] = int_add(sums[r][h], part[r][h][c]);
      }
    F16 d0, d1;
    block_scales<F>(w, panel, g, d0, d1);
    for (int r = 0; r < R; ++r) acc[r] = add_block<F>(acc[r], sums[r], d0, d1, blocks[r * G + g]);
  }
  const int count = static_cast<int>(std::min<int64_t>(16, N - panel * 16));
  for (int r = 0; r < R; ++r) store_out(y + r * N + panel * 16, acc[r], count);
}

#if defined(SERVAL_INT8_INT16_SUMS)
// Rows a pass of panel_rows_prepared: its accumulators (2 KiB) stay in L1, and each block is prepared once for 32
// rows (16 measured about 5% slower on the 1B's q4k linears at 96 rows, an AMD EPYC Zen 3).
constexpr int64_t kPreparedRows = 32;

// A block's codes as the unsigned bytes of its steps, ready for vpmaddubsw: out[i] holds step i's codes. The
// nibbles (steps 0-7) as they are, or for q6 with their two extra bits put above them (the 6-bit codes, so the steps
// 8-15 go unused); q5's fifth bits as 0 or 1 (steps 8-15, widened times 16).
template <int F>
inline void prepare_block(const uint8_t* q, Group* out) {
  // q6: step (L, low) multiplies positions 8 L + 2 s, whose bits are 0-1 (s even) or 4-5 (s odd) of extra row
  // 16 + 2 L + s / 2; (L, high) positions 8 L + 2 s + 1: bits 2-3 or 6-7. A lane of those rows' bytes as
  // [e0, e0, e1, e1] gives them by two shifts and masks.
  const __m256i rows01 = _mm256_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13,
                                          0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13);
  const __m256i rows23 = _mm256_add_epi8(rows01, _mm256_set1_epi8(2));
  const __m256i even = _mm256_set1_epi32(0x00300030), odd = _mm256_set1_epi32(0x30003000);
  for (int L = 0; L < 4; ++L) {
    const Group v = load_group(q + 64 * L);
    Group lo = mask(v, 0x0F), hi = mask(shift_right(v, 4), 0x0F);
    if constexpr (extra_bits(F) == 2) {
      const Group e = load_group(q + 256 + 64 * (L / 2));
      const __m256i order = L % 2 ? rows23 : rows01;
      for (int half = 0; half < 2; ++half) {
        const __m256i d = _mm256_shuffle_epi8(half ? e.b : e.a, order);
        const __m256i low_bits = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(d, 4), even),
                                                 _mm256_and_si256(d, odd));
        const __m256i high_bits = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(d, 2), even),
                                                  _mm256_and_si256(_mm256_srli_epi32(d, 2), odd));
        (half ? lo.b : lo.a) = _mm256_or_si256(half ? lo.b : lo.a, low_bits);
        (half ? hi.b : hi.a) = _mm256_or_si256(half ? hi.b : hi.a, high_bits);
      }
    }
    out[2 * L] = lo;
    out[2 * L + 1] = hi;
  }
  if constexpr (extra_bits(F) == 1) {  // bit b of row 16 + s
    const Group v = load_group(q + 256);
    for (int b = 0; b < 8; ++b) out[8 + b] = mask(shift_right(v, b), 0x01);
  }
}

// The 4-bit formats' rows whose dot products with one prepared block go together: each of the block's step groups
// is loaded once for all of them (their 8 int16 sums stay in registers). Row by row, the loads of the block's 16
// groups, not the multiplies, set the pace: 1.15-1.25x on the 1B's q4k linears at 96 rows, an AMD EPYC Zen 3, one
// thread. q6's steps (two pairs of int16 sums a half) measured 0.92-1.01x at 2 rows together: they stay row by row.
constexpr int64_t kRowsTogether = 4;

// An empty asm that takes v in registers: the sums are added step after step as written, not all products first
// (GCC reassociated the integer adds and kept the 64 products of a block on the stack).
inline void in_registers(Group& v) { asm volatile("" : "+x"(v.a), "+x"(v.b)); }

// A prepared block of a 4-bit format (extra_bits 0) times kRowsTogether rows (words: the first row's step words of
// the block, a row's stride apart; blocks likewise), into their accumulators: panel_rows_prepared's integer sums
// and add_block's float32 steps, so each row's bits are those of the row-by-row loop.
template <int F>
[[gnu::always_inline]] inline void rows_together(const Group* prepared, const int32_t* words, int64_t stride, F16 d0,
                                                 F16 d1, const BlockActivations* blocks, int64_t block_stride,
                                                 F16* acc) {
  static_assert(extra_bits(F) == 0);
  constexpr int R = kRowsTogether;
  Sums16 nibbles[R];
  const int32_t* x[R];
  for (int r = 0; r < R; ++r) {
    nibbles[r] = int_zero();
    x[r] = words + r * stride;
    // an opaque pointer a row: read at x[r] + 4 i (GCC kept all 32 row-and-step offsets on the stack instead)
    asm volatile("" : "+r"(x[r]));
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const Group v = prepared[i];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      nibbles[r] = dot16(nibbles[r], v, x[r][i]);
      in_registers(nibbles[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const Ints sums[2] = {widen(nibbles[r], 1), int_zero()};  // one scale a block: sums[1] unused
    acc[r] = add_block<F>(acc[r], sums, d0, d1, blocks[r * block_stride]);
  }
}

// panel_rows for the nibble formats with int16 sums, each block's steps prepared once for up to kPreparedRows rows.
// A u8 x s8 pair is at most 2 * 15 * 128 = 3,840 (4-bit codes), 2 * 1 * 128 (q5's fifth bits) or 2 * 63 * 128 =
// 16,128 (q6's 6-bit codes), so int16 holds the sums of a block's 8 nibble steps, of its 8 fifth-bit steps, or of
// 2 q6 steps: the same integers as panel_rows.
template <int F>
void panel_rows_prepared(const Panels& w, int64_t panel, int64_t rows, const int32_t* words,
                         const BlockActivations* blocks, float* y, int64_t N) {
  constexpr int S = steps(F);
  const int64_t G = w.groups;
  F16 acc[kPreparedRows];
  for (int64_t r = 0; r < rows; ++r) acc[r] = fzero();
  alignas(32) Group prepared[extra_bits(F) == 1 ? 16 : 8];
  for (int64_t g = 0; g < G; ++g) {
    prefetch_ahead<F>(w.packed + (panel * G + g) * block_rows(F) * 16);
    prepare_block<F>(w.packed + (panel * G + g) * block_rows(F) * 16, prepared);
    F16 d0, d1;
    block_scales<F>(w, panel, g, d0, d1);
    int64_t r = 0;
    if constexpr (extra_bits(F) == 0) {
      for (; r + kRowsTogether <= rows; r += kRowsTogether)
        rows_together<F>(prepared, words + (r * G + g) * S, G * S, d0, d1, blocks + r * G + g, G, acc + r);
    }
    for (; r < rows; ++r) {
      const int32_t* x = words + (r * G + g) * S;
      Ints sums[2];
      if constexpr (extra_bits(F) == 2) {
        for (int h = 0; h < 2; ++h) {  // steps 4 h - 4 h + 3: the half's positions
          const Sums16 a = dot16(dot16(int_zero(), prepared[4 * h], x[4 * h]), prepared[4 * h + 1], x[4 * h + 1]);
          const Sums16 b = dot16(dot16(int_zero(), prepared[4 * h + 2], x[4 * h + 2]), prepared[4 * h + 3],
                                 x[4 * h + 3]);
          sums[h] = int_add(widen(a, 1), widen(b, 1));
        }
      } else {
        Sums16 nibbles = int_zero();
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) nibbles = dot16(nibbles, prepared[i], x[i]);
        sums[0] = widen(nibbles, 1);
        if constexpr (extra_bits(F) == 1) {
          Sums16 bits = int_zero();
#pragma GCC unroll 8
          for (int b = 0; b < 8; ++b) bits = dot16(bits, prepared[8 + b], x[8 + b]);
          sums[0] = int_add(sums[0], widen(bits, 16));
        }
        sums[1] = sums[0];  // unused: one scale a block
      }
      acc[r] = add_block<F>(acc[r], sums, d0, d1, blocks[r * G + g]);
    }
  }
  const int count = static_cast<int>(std::min<int64_t>(16, N - panel * 16));
  for (int64_t r = 0; r < rows; ++r) store_out(y + r * N + panel * 16, acc[r], count);
}
#endif

template <int F, int R>
void rows_tail(int64_t rows, const Panels& w, int64_t panel, const int32_t* words, const BlockActivations* blocks,
               float* y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return panel_rows<F, R>(w, panel, words, blocks, y, N);
    rows_tail<F, R - 1>(rows, w, panel, words, blocks, y, N);
  }
}

constexpr int64_t kTileRowsAmx = 16;  // rows of a C tile (and of A); a call's rows are padded to a multiple of 16

#if SERVAL_INT8_KERNEL == 512 && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SERVAL_INT8_AMX
// AMX tiles (Intel Sapphire Rapids and later), for many rows: the same integer sums, 16 rows by 16 columns a tile
// dot product. tdpbsud (signed A times unsigned B; tdpbssd for q8's signed codes) adds to C[r][n], over i, the
// products of A's bytes 4 i .. 4 i + 3 of row r with B's bytes 4 n .. 4 n + 3 of row i. B's row i is the group that
// panel_rows dots with step word i (16 columns' 4 bytes a lane, load_group); A's row r is row r's step words of the
// block, as quantize_rows laid them out. So one tile dot product per block into a zeroed C gives each (row, column)
// exactly the block's integer sum that panel_rows builds with vpdpbusd (integers below 2^31: exact in any order).
// The float32 steps after it are panel_rows's, the same operations block after block. Hence the bits of the vector
// kernel for every output, whichever kernel a call's row count picks and whatever rows share the call: batch
// invariance holds across the switch (tests/layers/test_int8_amx.py). q6k and q6f, two sums per block over steps
// that are not contiguous words, stay on the vector kernel.
constexpr bool amx_format(int f) { return !sub_blocks_of_16(f); }
// The fewest rows for which the tiles are used. Measured (benchmarks/bench_int8_amx.py, SmolLM2's Q4_1 linears, Xeon
// model 167): on 1 thread the tiles were 1.1-1.4x faster from 16 rows, but on 2 threads 0.8-0.9x at 16 and 32 rows
// for the narrow linears (each thread unpacks its panels' blocks for only 1 or 2 tiles of rows), 1.1-1.6x from 64.
constexpr int64_t kAmxMinRows = 64;

// ldtilecfg's 64 bytes (palette 1): per tile register its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Whether tile instructions may run: the CPU has AMX-INT8 (CPUID 7.0 EDX bit 25) and Linux grants this process the
// tile data state (XFEATURE 18), asked once; without that grant the first tile instruction faults.
bool amx_int8_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 25) & 1)) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// Block q of a panel as a B tile: its steps(F) groups, 64 bytes each, in step order (the codes panel_rows dots).
template <int F>
void unpack_block(const uint8_t* q, uint8_t* b) {
  const auto put = [b](int i, Group v) { _mm512_storeu_si512(b + 64 * i, v); };
  if constexpr (F == kQ8) {
    for (int L = 0; L < 8; ++L) put(L, load_group(q + 64 * L));
  } else {
    for (int L = 0; L < 4; ++L) {
      const Group v = load_group(q + 64 * L);
      put(2 * L, mask(v, 0x0F));
      put(2 * L + 1, mask(shift_right(v, 4), 0x0F));
    }
    if constexpr (extra_bits(F) == 1) {  // bit b of row 16 + s, times 16
      const Group v = load_group(q + 256);
      for (int b = 0; b < 8; ++b) put(8 + b, mask(b < 4 ? shift_left(v, 4 - b) : shift_right(v, b - 4), 0x10));
    }
  }
}

// The tile instructions' asm names no memory they read: stores to a tile's source must be done before it.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// One block's integer sums for 16 rows into C on the tile set Set (0: C tmm0, A tmm2, B tmm4; 1: tmm1, tmm3, tmm5):
// A the rows' step words (row stride: a row's words), B the block's unpacked groups.
template <int F, int Set>
__attribute__((target("amx-tile,amx-int8"))) inline void tile_block_dot(const int32_t* words, int64_t stride,
                                                                         const uint8_t* groups) {
  if constexpr (Set == 0) {
    _tile_zero(0);
    _tile_loadd(2, words, stride);
    _tile_loadd(4, groups, 64);
    if constexpr (F == kQ8) _tile_dpbssd(0, 2, 4); else _tile_dpbsud(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, words, stride);
    _tile_loadd(5, groups, 64);
    if constexpr (F == kQ8) _tile_dpbssd(1, 3, 5); else _tile_dpbsud(1, 3, 5);
  }
}

// Set's C tile: 16 rows of 16 int32 sums.
template <int Set>
__attribute__((target("amx-tile"))) inline void tile_store_sums(int32_t* sums) {
  if constexpr (Set == 0) _tile_stored(0, sums, 64); else _tile_stored(1, sums, 64);
}

// panel_rows's float32 steps of block g for 16 rows (blocks: the first row's), from the block's integer sums.
template <int F>
inline void block_steps(const Panels& w, int64_t panel, int64_t g, const int32_t* sums, const BlockActivations* blocks,
                        F16 (&acc)[kTileRowsAmx]) {
  F16 d0, d1;
  block_scales<F>(w, panel, g, d0, d1);
#pragma GCC unroll 16
  for (int r = 0; r < kTileRowsAmx; ++r) {
    const BlockActivations& b = blocks[r * w.groups + g];
    const Ints sum = _mm512_load_si512(sums + 16 * r);
    acc[r] = ffma(fmul(d0, fset1(b.dx)), to_float(sum), acc[r]);
    if constexpr (F != kQ8) acc[r] = ffma(d1, fset1(b.dx_sum), acc[r]);
  }
}

// One row tile's (16 rows') walk over one panel's blocks.
struct TileWalk {
  const Panels& w;
  int64_t panel;
  const int32_t* words;  // the first row's, of block 0; a row's words are stride bytes apart
  int64_t stride;
  const uint8_t* groups;  // the panel's unpacked blocks
  const BlockActivations* blocks;  // the first row's, of block 0
  int32_t (*sums)[kTileRowsAmx * 16];  // one buffer per tile set
};

// Step g of a row tile's walk, a pipeline of three stages a block apart: block g + 1's dot product issued, block g's
// sums stored (tile set Set), block g - 1's float32 steps. The tile unit runs its instructions in order, and a tile
// store's data reaches vector loads late: so each stage finds its input done (with a block's dot product, store and
// steps back to back, perf showed the time spent waiting at the dot product and the store).
template <int F, int Set>
[[gnu::always_inline]] __attribute__((target("amx-tile,amx-int8"))) inline void walk_step(const TileWalk& t,
                                                                                          int64_t g,
                                                                                          F16 (&acc)[kTileRowsAmx]) {
  constexpr int S = steps(F), Next = 1 - Set;
  const int64_t G = t.w.groups;
  if (g + 1 < G) tile_block_dot<F, Next>(t.words + (g + 1) * S, t.stride, t.groups + (g + 1) * S * 64);
  if (g < G) tile_store_sums<Set>(t.sums[Set]);
  if (g >= 1) block_steps<F>(t.w, t.panel, g - 1, t.sums[Next], t.blocks, acc);
}

// Rows [0, M) (words and blocks padded to a multiple of 16 rows) times panels [begin, end), on tiles: per panel its
// blocks unpacked once, then per 16 rows and block one tile dot product and panel_rows's float32 steps.
template <int F>
__attribute__((target("amx-tile,amx-int8"))) void amx_panels(const Panels& w, int64_t begin, int64_t end,
                                                              const int32_t* words, const BlockActivations* blocks,
                                                              int64_t M, float* y, int64_t N) {
  constexpr int S = steps(F);
  const int64_t G = w.groups, stride = G * S * sizeof(int32_t);
  TileConfig config;
  for (int set = 0; set < 2; ++set) {
    config.rows[set] = kTileRowsAmx, config.bytes_per_row[set] = 64;          // C: 16 rows of 16 int32 sums
    config.rows[2 + set] = kTileRowsAmx, config.bytes_per_row[2 + set] = 4 * S;  // A: 16 rows' words of a block
    config.rows[4 + set] = S, config.bytes_per_row[4 + set] = 64;               // B: the block's S groups
  }
  memory_barrier();
  _tile_loadconfig(&config);
  uint8_t* unpacked = reinterpret_cast<uint8_t*>(serval::scratch(4, G * S * 64 / sizeof(float)));
  alignas(64) int32_t sums[2][kTileRowsAmx * 16];
  for (int64_t p = begin; p < end; ++p) {
    for (int64_t g = 0; g < G; ++g) unpack_block<F>(w.packed + (p * G + g) * block_rows(F) * 16, unpacked + g * S * 64);
    memory_barrier();
    const int count = static_cast<int>(std::min<int64_t>(16, N - p * 16));
    for (int64_t r0 = 0; r0 < M; r0 += kTileRowsAmx) {
      F16 acc[kTileRowsAmx];
      for (int r = 0; r < kTileRowsAmx; ++r) acc[r] = fzero();
      const TileWalk walk{w, p, words + r0 * G * S, stride, unpacked, blocks + r0 * G, sums};
      tile_block_dot<F, 0>(walk.words, stride, unpacked);
      for (int64_t g = 0; g <= G; g += 2) {  // block g on tile set 0, g + 1 on set 1
        walk_step<F, 0>(walk, g, acc);
        if (g + 1 <= G) walk_step<F, 1>(walk, g + 1, acc);
      }
      for (int r = 0; r < kTileRowsAmx && r0 + r < M; ++r) store_out(y + (r0 + r) * N + p * 16, acc[r], count);
    }
  }
  _tile_release();  // the thread's tile state back to its initial (empty) state: cheaper context switches
}
#endif

// Which kernel a call asks for: the tiles where they pay (kAuto), or one of them (tests, benchmarks).
enum class Kernel { kAuto, kVector, kAmx };

// Whether the call runs on AMX tiles.
template <int F>
bool use_amx(int64_t M, Kernel kernel) {
#if defined(SERVAL_INT8_AMX)
  if constexpr (amx_format(F)) {
    if (kernel == Kernel::kAmx) TORCH_CHECK(amx_int8_usable(), "AMX-INT8 tiles are not usable on this CPU");
    return kernel == Kernel::kAmx || (kernel == Kernel::kAuto && M >= kAmxMinRows && amx_int8_usable());
  }
#endif
  TORCH_CHECK(kernel != Kernel::kAmx, "no AMX kernel for this format or build");
  return false;
}

// Rows from which a call's activations are quantized by all of its threads, not the caller alone.
constexpr int64_t kQuantizeGrain = 8;

template <int F>
void gemm_int8(const float* x, int64_t M, int64_t K, const Panels& w, int64_t N, float* y, Kernel kernel) {
  const int64_t G = w.groups;
  const bool amx = use_amx<F>(M, kernel);
  const int64_t padded = amx ? (M + kTileRowsAmx - 1) / kTileRowsAmx * kTileRowsAmx : M;
  int32_t* words = reinterpret_cast<int32_t*>(serval::scratch(2, padded * G * steps(F)));
  BlockActivations* blocks =
      reinterpret_cast<BlockActivations*>(serval::scratch(3, padded * G * sizeof(BlockActivations) / sizeof(float)));
  // by all the call's threads from kQuantizeGrain rows (each row's codes are its own): on the caller alone it took
  // about 1.3% of a 96-row q4k call on one thread, time the other threads waited for (perf, AMD EPYC Zen 3)
  serval::parallel_for(0, M, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    quantize_rows<F>(x + begin * K, end - begin, K, G, words + begin * G * steps(F), blocks + begin * G);
  });
  if (amx) {  // the padding rows' sums and steps are computed, never stored: zeros keep them plain numbers
    std::memset(words + M * G * steps(F), 0, (padded - M) * G * steps(F) * sizeof(int32_t));
    std::memset(blocks + M * G, 0, (padded - M) * G * sizeof(BlockActivations));
  }
  const int64_t panels = (N + 15) / 16;
  serval::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
#if defined(SERVAL_INT8_AMX)
    if constexpr (amx_format(F)) {
      if (amx) return amx_panels<F>(w, begin, end, words, blocks, M, y, N);
    }
#endif
    for (int64_t p = begin; p < end; ++p) {
      int64_t r0 = 0;
#if defined(SERVAL_INT8_INT16_SUMS)
      if constexpr (F != kQ8) {  // up to 3 rows left go to panel_rows: the same bits, no preparing per block
        for (int64_t rows; (rows = std::min(kPreparedRows, M - r0)) >= kTileRows; r0 += rows)
          panel_rows_prepared<F>(w, p, rows, words + r0 * G * steps(F), blocks + r0 * G, y + r0 * N, N);
      }
#endif
      for (; r0 + kTileRows <= M; r0 += kTileRows)
        panel_rows<F, kTileRows>(w, p, words + r0 * G * steps(F), blocks + r0 * G, y + r0 * N, N);
      rows_tail<F, kTileRows - 1>(M - r0, w, p, words + r0 * G * steps(F), blocks + r0 * G, y + r0 * N, N);
    }
  });
}

void gemm_format(int f, const float* x, int64_t M, int64_t K, const Panels& w, int64_t N, float* y, Kernel k) {
  switch (f) {
    case kQ8: return gemm_int8<kQ8>(x, M, K, w, N, y, k);
    case kQ4: return gemm_int8<kQ4>(x, M, K, w, N, y, k);
    case kQ5: return gemm_int8<kQ5>(x, M, K, w, N, y, k);
    case kQ4F: return gemm_int8<kQ4F>(x, M, K, w, N, y, k);
    case kQ5F: return gemm_int8<kQ5F>(x, M, K, w, N, y, k);
    case kQ6F: return gemm_int8<kQ6F>(x, M, K, w, N, y, k);
    case kQ4K: return gemm_int8<kQ4K>(x, M, K, w, N, y, k);
    case kQ5K: return gemm_int8<kQ5K>(x, M, K, w, N, y, k);
    default: return gemm_int8<kQ6K>(x, M, K, w, N, y, k);
  }
}
#endif

}  // namespace

bool block_int8_kernel_available() {
#if defined(SERVAL_INT8_KERNEL)
  return true;
#else
  return false;
#endif
}

bool block_int8_amx_available() {
#if defined(SERVAL_INT8_AMX)
  return amx_int8_usable();
#else
  return false;
#endif
}

// block_panel_linear's arguments and result (panel_linear.cpp), computed with int8 activations. kernel: "auto" (AMX
// tiles from kAmxMinRows rows where usable, else the vector kernel), "vector" or "amx": the same bits.
at::Tensor block_panel_linear_int8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                   const std::string& format, int64_t out_features, bool float_output,
                                   const std::string& kernel) {
  const BlockCall call = check_block_call(x, panels, scales, format, out_features);
  TORCH_CHECK(kernel == "auto" || kernel == "vector" || kernel == "amx", "kernel: auto, vector or amx, not ", kernel);
  const int f = call.format;
  const int64_t M = call.rows, K = call.in_features, N = call.out_features, groups = call.groups;
#if defined(SERVAL_INT8_KERNEL)
  // x as float32 rows and bfloat16 results written here, not by aten ops: at one row a call's fixed costs are a good
  // part of its time.
  const at::Tensor xc = x.contiguous();
  const float* xf = nullptr;
  if (x.scalar_type() == at::kFloat) {
    xf = xc.data_ptr<float>();
  } else {
    float* rows = serval::scratch(1, M * K);  // slots 2 and 3 are the quantized rows'
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "block_panel_linear_int8", [&] {
      const scalar_t* src = xc.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M * K; ++i) rows[i] = static_cast<float>(src[i]);
    });
    xf = rows;
  }
  const Panels w{panels.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.data_ptr()), groups};
  const Kernel k = kernel == "amx" ? Kernel::kAmx : kernel == "vector" ? Kernel::kVector : Kernel::kAuto;
  if (x.scalar_type() == at::kBFloat16 && !float_output) {
    float* yf = serval::scratch(0, M * N);
    gemm_format(f, xf, M, K, w, N, yf, k);
    at::Tensor y = at::empty({M, N}, x.options());
    to_bfloat16(yf, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M * N);
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_format(f, xf, M, K, w, N, y.data_ptr<float>(), k);
  return float_output || x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "block_panel_linear_int8 needs AVX2 with FMA and F16C (check block_int8_kernel_available())");
#endif
}
