// fused_ops.cpp's silu_and_mul for bfloat16, 16 lanes at a time. fused_ops.cpp converts each value to and from
// bfloat16 by scalar code (c10::BFloat16) around its vector silu, which cost a 16-row decode step of SmolLM2 1.8 ms
// on one thread (61 us a layer), more than the silu. Here the conversions are vector instructions doing what c10's
// do, bit for bit: widening is a shift, narrowing rounds to nearest even and turns every NaN into 0x7FC0. The rest
// is the scalar code's operations, lane by lane, so the results are fused_ops.cpp's to the bit
// (tests/layers/test_bf16_rows.py), with AVX-512 and AVX2 alike (V16 of vec_math.h). Other dtypes and builds
// without AVX2 go to fused_ops.cpp's function. (Its add_rms_norm and rotary_embedding_ were measured the same way
// and gained 4%: the compiler vectorizes their conversion loops already.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "thread_pool.h"
#include "vec_math.h"

#include "kernels.h"  // fused_ops.cpp's silu_and_mul: every case silu_and_mul_v16 does not take

#if defined(SERVAL_V16)
namespace {

using bf16 = c10::BFloat16;
using serval::V16;

#if defined(__AVX512F__)
inline V16 load_bf16(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}

// c10's round_to_nearest_even: NaN -> 0x7FC0, else (bits + 0x7FFF + bit 16) >> 16; in 32-bit lanes.
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline void store_bf16(bf16* p, V16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x.v)));
}

// x rounded to bfloat16 and widened back: static_cast<float>(static_cast<bf16>(x)).
inline V16 round_bf16(V16 x) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x.v), 16))}; }
#else
inline __m256 load_bf16x8(const bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline V16 load_bf16(const bf16* p) { return {load_bf16x8(p), load_bf16x8(p + 8)}; }

inline __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline void store_bf16(bf16* p, V16 x) {
  // Values below 2^16: packing with unsigned saturation keeps them; the pack works per 128-bit lane, the permute
  // puts the halves back in order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits(x.lo), bf16_bits(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

inline __m256 round_bf16x8(__m256 x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
inline V16 round_bf16(V16 x) { return {round_bf16x8(x.lo), round_bf16x8(x.hi)}; }
#endif

// Up to 16 values through a buffer padded with zeros (the row's last, partial vector).
inline V16 load_bf16_partial(const bf16* p, int64_t count) {
  alignas(64) bf16 buffer[16] = {};
  std::copy(p, p + count, buffer);
  return load_bf16(buffer);
}

inline void store_bf16_partial(bf16* p, V16 x, int64_t count) {
  alignas(64) bf16 buffer[16];
  store_bf16(buffer, x);
  std::copy(buffer, buffer + count, p);
}

// fused_ops.cpp's silu_and_mul_rows for bfloat16: the same vector silu on 16 gates at a time (the last ones padded
// with zeros), rounded, times up, rounded.
void silu_and_mul_rows(const bf16* x, bf16* out, int64_t rows, int64_t n) {
  serval::parallel_for(0, rows, std::max<int64_t>(1, 8192 / n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bf16* gate = x + row * 2 * n;
      const bf16* up = gate + n;
      bf16* o = out + row * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        store_bf16(o + i, serval::mul16(round_bf16(serval::silu16(load_bf16(gate + i))), load_bf16(up + i)));
      if (i < n) {
        const int64_t count = n - i;
        const V16 g = serval::silu16(load_bf16_partial(gate + i, count));
        store_bf16_partial(o + i, serval::mul16(round_bf16(g), load_bf16_partial(up + i, count)), count);
      }
    }
  });
}

}  // namespace
#endif

// silu_and_mul of fused_ops.cpp, the same results; bfloat16 16 lanes at a time.
at::Tensor silu_and_mul_v16(const at::Tensor& x) {
#if defined(SERVAL_V16)
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0) {
    const int64_t n = x.size(1) / 2;
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    if (n > 0) silu_and_mul_rows(x.data_ptr<bf16>(), out.data_ptr<bf16>(), x.size(0), n);
    return out;
  }
#endif
  return silu_and_mul(x);
}
