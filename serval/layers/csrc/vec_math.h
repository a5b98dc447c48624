// Vector math shared by the CPU kernels: the same instructions wherever a function is used, so a value computed
// in one kernel and recomputed in another (a decode, then a prefill after preemption) gets the same bits.
//
// V16 is 16 float32 lanes: one AVX-512 register, or two AVX2 ones. Every operation is lane by lane (or a fixed
// reduction tree), so code written over V16 gives the same bits from an AVX-512 build and an AVX2 one.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define SERVAL_V16 1
#include <immintrin.h>

#include <cstdint>

namespace serval {

#if defined(__AVX512F__)
// e^x for x <= 0, within about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial for e^r,
// scaled by 2^n in two exact steps. -inf gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in float32 already
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: n * hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  // 2^n = 2^h * 2^(n - h), h = floor(n / 2) >= -75: both factors normal, p * 2^h exact, one rounding at the end
  const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(n, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(h), bias), 23));
  const __m512 b = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(n, h)), bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, a), b);
}
#endif

// The same for 8 lanes, instruction for instruction.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606820309417e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 h = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(h), bias), 23));
  const __m256 b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_sub_ps(n, h)), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// tanh(x) within about 2 ulp, for every float x (+-inf give +-1): with t = |x|, below 0.55 an odd polynomial
// t + t^3 P(t^2) (P fitted to tanh on [0, 0.55]), from 0.55 up (1 - e) / (1 + e) with e = e^-2t <= 1/3 (no
// cancellation); then the sign of x. Both branches are computed for every lane and one is kept, so a lane's result
// depends on its own x alone.
#if defined(__AVX512F__)
inline __m512 tanh_ps(__m512 x) {
  const __m512 t = _mm512_abs_ps(x), u = _mm512_mul_ps(t, t);
  __m512 p = _mm512_set1_ps(-0.00644637877f);
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(0.0211985633f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-0.0538845398f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(0.133329079f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-0.333333284f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(t, u), p, t);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(t, _mm512_set1_ps(-2.f)));
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(0.55f), _CMP_LT_OQ), large, small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}
#endif

// The same for 8 lanes, instruction for instruction.
inline __m256 tanh_ps(__m256 x) {
  const __m256 t = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x), u = _mm256_mul_ps(t, t);
  __m256 p = _mm256_set1_ps(-0.00644637877f);
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(0.0211985633f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-0.0538845398f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(0.133329079f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-0.333333284f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(t, u), p, t);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(t, _mm256_set1_ps(-2.f)));
  const __m256 large = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.f), e), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  const __m256 r = _mm256_blendv_ps(large, small, _mm256_cmp_ps(t, _mm256_set1_ps(0.55f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(x, _mm256_set1_ps(-0.f)));
}

// Lanes (i, i + 8), then (i, i + 4), (i, i + 2), (0, 1): the tree both builds use.
template <typename Op>
inline float reduce8(__m256 v, Op op) {
  const __m128 four = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = op(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(op(two, _mm_movehdup_ps(two)));
}

#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 max16(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 exp_nonpositive16(V16 a) { return {exp_nonpositive(a.v)}; }
inline V16 div16(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 tanh16(V16 a) { return {tanh_ps(a.v)}; }
// Lanes count .. 15 replaced by fill.
inline V16 first_lanes(V16 a, int64_t count, float fill) {
  if (count >= 16) return a;
  const __mmask16 keep = count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
  return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), a.v)};
}
inline __m256 half16(V16 a, int i) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), i));
}
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 max16(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 exp_nonpositive16(V16 a) { return {exp_nonpositive(a.lo), exp_nonpositive(a.hi)}; }
inline V16 div16(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 tanh16(V16 a) { return {tanh_ps(a.lo), tanh_ps(a.hi)}; }
inline V16 first_lanes(V16 a, int64_t count, float fill) {
  if (count >= 16) return a;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i n = _mm256_set1_epi32(static_cast<int>(count < 0 ? 0 : count));
  const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
  const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, keep_lo), _mm256_blendv_ps(f, a.hi, keep_hi)};
}
inline __m256 half16(V16 a, int i) { return i == 0 ? a.lo : a.hi; }
#endif

// silu(g) = g / (1 + e^-g), with e^-|g| so the exponent is never positive (no overflow for very negative g).
inline __m256 silu(__m256 g) {
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), g);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), abs));
  const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#if defined(__AVX512F__)
inline __m512 silu(__m512 g) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
  return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
inline V16 silu16(V16 a) { return {silu(a.v)}; }
#else
inline V16 silu16(V16 a) { return {silu(a.lo), silu(a.hi)}; }
#endif

inline float reduce_add16(V16 a) {
  return reduce8(_mm256_add_ps(half16(a, 0), half16(a, 1)), [](__m128 x, __m128 y) { return _mm_add_ps(x, y); });
}
inline float reduce_max16(V16 a) {
  return reduce8(_mm256_max_ps(half16(a, 0), half16(a, 1)), [](__m128 x, __m128 y) { return _mm_max_ps(x, y); });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The first count lanes of 16 (all from 16 up).
inline __mmask16 first_mask16(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}
// float32 to bfloat16 bits, rounding to nearest even as c10::BFloat16 does (NaN to its quiet NaN); the first count
// lanes stored (the block kernels' outputs).
inline void store_bfloat16(uint16_t* y, __m512 v, int64_t count) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_mask_storeu_epi16(y, first_mask16(count), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

}  // namespace serval
#endif
