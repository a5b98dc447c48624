// Paged attention on the CPU, reading keys and values straight from the block cache.
//
// Each query's result depends only on its own query vector, its keys and values, and its context length: the
// arithmetic for one query never looks at another query, at padding, or at how the batch was cut into chunks.
// That makes greedy output independent of batching, chunking and preemption by construction (a token decoded
// one step and recomputed in a prefill chunk after a preemption gets the same bits). Scores, softmax and the
// weighted sum are float32.
//
// With AVX-512 or AVX2 (the same arithmetic, the same bits: vec_math.h), the queries of one sequence are taken in
// tiles that share its keys and values, converted to float32 once per tile: keys transposed in groups of 16 so
// that 16 lanes hold 16 keys' scores (each a float32 FMA chain over the head dimension in order), a vectorized
// exp, and values summed in key order. A prefill chunk's many queries then cost little more than their FLOPs.
// A sliding window (Gemma's local layers) limits each query to its last ``window`` keys: the keys before them get
// a score of -inf (an exact 0 after the exp), and a query's tiles start at the 16-key tile of its first key, so the
// result does not depend on the other queries of its tile either.
// Soft-capping (Gemma 2's attention logits) turns each scaled score s into softcap * tanh(s / softcap) as it is
// scored, by the one vectorized tanh of vec_math.h for every query; without a cap the scoring code is the same
// instructions as ever (a template argument), so other models' results keep their bits.
// Elsewhere, one query at a time (the cap by std::tanh).
//
// The cache rows are 16- or 32-bit floats, or (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2) 8-bit codes followed by
// the row's float32 scale (one row = one token's one key or value head): a row is value = code * scale, dequantized
// as it is read, and quantize_kv_ writes the rows from each token alone, so batch invariance holds there too.
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "scratch.h"
#include "thread_pool.h"
#include "vec_math.h"

namespace {

// A dot product in 16 independent lanes: the compiler turns the inner loop into vector FMAs without reordering
// any one lane's sum (no -ffast-math), so the result is fixed for a given input.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int i = 0; i < 16; ++i) lanes[i] += a[d + i] * b[d + i];
  for (; d < n; ++d) lanes[0] += a[d] * b[d];
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return sum;
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// How the cache stores a row of head_dim values: as floats (the model's dtype), or as 8-bit codes and a scale.
template <typename T>
struct PlainRows {
  using storage = T;
  static constexpr int64_t extra = 0;  // storage elements after the head_dim values
};

template <typename Code>
struct ScaledRows {  // head_dim 8-bit codes, then the row's float32 scale (4 bytes)
  using storage = uint8_t;
  static constexpr int64_t extra = 4;
  // float32 of every code: exact, and read by table (a gather when vectorized) so every build agrees.
  static const float* table() {
    static const std::array<float, 256> values = [] {
      std::array<float, 256> t{};
      for (int b = 0; b < 256; ++b) t[b] = decode(static_cast<uint8_t>(b));
      return t;
    }();
    return values.data();
  }
  static float decode(uint8_t b) {
    if constexpr (std::is_same_v<Code, int8_t>) return static_cast<float>(static_cast<int8_t>(b));
    else return static_cast<float>(Code(b, Code::from_bits()));
  }
  static uint8_t encode(float x) {  // x within the code's range (the scale sees to it)
    if constexpr (std::is_same_v<Code, int8_t>)
      return static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.f, 127.f)));
    else return Code(x).x;
  }
  static constexpr float max_code() {
    if constexpr (std::is_same_v<Code, int8_t>) return 127.f;
    else if constexpr (std::is_same_v<Code, c10::Float8_e4m3fn>) return 448.f;
    else return 57344.f;
  }
};

template <typename Rows>
inline float row_scale(const typename Rows::storage* row, int64_t head_dim) {
  if constexpr (Rows::extra == 0) {
    return 1.f;
  } else {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(float));
    return scale;
  }
}

// A cache row as float32 (scalar: the per-query path).
template <typename Rows>
inline void dequantize_row(const typename Rows::storage* row, float* dst, int64_t head_dim) {
  if constexpr (Rows::extra == 0) {
    load_row(row, dst, head_dim);
  } else {
    const float scale = row_scale<Rows>(row, head_dim);
    const float* table = Rows::table();
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = table[row[i]] * scale;
  }
}

// One call's inputs as sizes and pointers (see paged_attention below for their shapes).
template <typename scalar_t, typename Rows>
struct Inputs {
  using storage = typename Rows::storage;
  int64_t num_tokens, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks;
  const scalar_t* q;
  const storage *kc, *vc;
  const int64_t *tables, *rows, *lens;
  scalar_t* o;
  float scale;
  int64_t window;  // 0: every key of the prefix; else each query's last ``window`` keys
  float softcap;   // 0: scores as they are; else each scaled score s becomes softcap * tanh(s / softcap)

  Inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& token_table, const at::Tensor& context_lens,
         double softmax_scale, int64_t window, double softcap, at::Tensor& out)
      : num_tokens(query.size(0)), num_heads(query.size(1)), head_dim(query.size(2)), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads), max_blocks(block_tables.size(1)),
        q(query.data_ptr<scalar_t>()), kc(static_cast<const storage*>(k_cache.data_ptr())),
        vc(static_cast<const storage*>(v_cache.data_ptr())),
        tables(block_tables.data_ptr<int64_t>()), rows(token_table.data_ptr<int64_t>()),
        lens(context_lens.data_ptr<int64_t>()), o(out.data_ptr<scalar_t>()), scale(static_cast<float>(softmax_scale)),
        window(window), softcap(static_cast<float>(softcap)) {}

  // The first key a query of context ``ctx`` attends to.
  int64_t first_key(int64_t ctx) const { return window > 0 && ctx > window ? ctx - window : 0; }
};

template <typename scalar_t, typename Rows>
void attend(const Inputs<scalar_t, Rows>& in) {
  const auto [num_tokens, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks, q, kc, vc, tables, rows,
              lens, o, fscale, window, softcap] = in;

  const int64_t row_stride = head_dim + Rows::extra;
  serval::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), kf(head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t ctx = lens[t], first = in.first_key(ctx);
      const int64_t* table = tables + rows[t] * max_blocks;
      scores.assign(group * ctx, 0.f);
      load_row(q + (t * num_heads + kvh * group) * head_dim, qf.data(), group * head_dim);
      for (int64_t l = first; l < ctx; ++l) {  // scores, one key at a time, shared by the query heads of this group
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        dequantize_row<Rows>(kc + (slot * num_kv_heads + kvh) * row_stride, kf.data(), head_dim);
        for (int64_t g = 0; g < group; ++g)
          scores[g * ctx + l] = dot(qf.data() + g * head_dim, kf.data(), head_dim) * fscale;
      }
      if (softcap > 0.f)
        for (int64_t g = 0; g < group; ++g)
          for (float* s = scores.data() + g * ctx + first; s < scores.data() + (g + 1) * ctx; ++s)
            *s = softcap * std::tanh(*s / softcap);
      std::vector<float> sums(group);
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators, in place
        float* s = scores.data() + g * ctx;
        const float max = *std::max_element(s + first, s + ctx);
        float sum = 0.f;
        for (int64_t l = first; l < ctx; ++l) {
          s[l] = std::exp(s[l] - max);
          sum += s[l];
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = first; l < ctx; ++l) {  // the weighted sum of values, in key order
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        dequantize_row<Rows>(vc + (slot * num_kv_heads + kvh) * row_stride, kf.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + l];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o + (t * num_heads + kvh * group + g) * head_dim;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}


#if defined(SERVAL_V16)
#define SERVAL_TILED_ATTENTION 1
using serval::V16;
constexpr int64_t kKeys = 16;       // keys per score vector
constexpr int64_t kQueryTile = 64;  // query tokens of one sequence that share one float32 copy of its keys and values
// Keys that every query head of a tile takes in turn: 64 keys' float32 copies (16 KB at head_dim 64) stay in L1
// while a tile's query heads score them and sum their values (from L2, 256 keys ran at half the FMA rate).
constexpr int64_t kBlockKeys = 64;
constexpr int kBlockTiles = kBlockKeys / kKeys;
// Query heads scored side by side on one load of the keys: AVX-512 holds 4 heads x 4 tiles of sums and the 4 tiles
// in its 32 registers; AVX2's 16 (a V16 is two) hold one head's.
#if defined(__AVX512F__)
constexpr int kScoreHeads = 4;
#else
constexpr int kScoreHeads = 1;
#endif

// Scores of J consecutive 16-key tiles for Q query heads (q + h * head_dim, scores + h * score_stride): each lane
// an FMA chain over the head dimension in order (the heads and tiles only share the loads of the keys and of the
// query; every score's arithmetic is the same whatever J and Q), scaled, and with Capped soft-capped to
// softcap * tanh(s / softcap).
template <int J, int Q, bool Capped>
inline void score_tiles(const float* q, const float* kt, int64_t head_dim, int64_t j0, int64_t ctx, float scale,
                        float softcap, float* scores, int64_t score_stride) {
  V16 acc[Q][J];
  for (int h = 0; h < Q; ++h)
    for (int j = 0; j < J; ++j) acc[h][j] = serval::zero16();
  for (int64_t d = 0; d < head_dim; ++d) {
    V16 k[J];
    for (int j = 0; j < J; ++j) k[j] = serval::load16(kt + ((j0 + j) * head_dim + d) * kKeys);
    for (int h = 0; h < Q; ++h) {
      const V16 qd = serval::set16(q[h * head_dim + d]);
      for (int j = 0; j < J; ++j) acc[h][j] = serval::fma16(qd, k[j], acc[h][j]);
    }
  }
  for (int h = 0; h < Q; ++h)
    for (int j = 0; j < J; ++j) {
      const int64_t first = (j0 + j) * kKeys;
      V16 s = serval::mul16(acc[h][j], serval::set16(scale));
      if constexpr (Capped)
        s = serval::mul16(serval::tanh16(serval::div16(s, serval::set16(softcap))), serval::set16(softcap));
      serval::store16(scores + h * score_stride + first, serval::first_lanes(s, ctx - first, -INFINITY));
    }
}

// Scores of 16-key tiles j0 .. j1 (at most a block's) for Q query heads.
template <int Q, bool Capped>
inline void score_range(const float* q, const float* kt, int64_t head_dim, int64_t j0, int64_t j1, int64_t ctx,
                        float scale, float softcap, float* scores, int64_t score_stride) {
  if (j1 - j0 == kBlockTiles)
    return score_tiles<kBlockTiles, Q, Capped>(q, kt, head_dim, j0, ctx, scale, softcap, scores, score_stride);
  for (int64_t j = j0; j < j1; ++j)
    score_tiles<1, Q, Capped>(q, kt, head_dim, j, ctx, scale, softcap, scores, score_stride);
}

// score_range for ``heads`` consecutive query heads (one token's), kScoreHeads at a time.
template <bool Capped>
inline void score_heads(int64_t heads, const float* q, const float* kt, int64_t head_dim, int64_t j0, int64_t j1,
                        int64_t ctx, float scale, float softcap, float* scores, int64_t score_stride) {
  for (int64_t h = 0; h < heads; h += kScoreHeads) {
    const float* qh = q + h * head_dim;
    float* sh = scores + h * score_stride;
    const int64_t n = std::min<int64_t>(kScoreHeads, heads - h);
    if (n == 4) score_range<4, Capped>(qh, kt, head_dim, j0, j1, ctx, scale, softcap, sh, score_stride);
    else if (n == 3) score_range<3, Capped>(qh, kt, head_dim, j0, j1, ctx, scale, softcap, sh, score_stride);
    else if (n == 2) score_range<2, Capped>(qh, kt, head_dim, j0, j1, ctx, scale, softcap, sh, score_stride);
    else score_range<1, Capped>(qh, kt, head_dim, j0, j1, ctx, scale, softcap, sh, score_stride);
  }
}

// One query head's scores over its keys (tiles j0 .. of its ctx keys) become softmax numerators, in place; returns
// 1 / their sum.
inline float softmax_numerators(float* scores, int64_t j0, int64_t ctx) {
  const int64_t tiles = (ctx + kKeys - 1) / kKeys;
  V16 top = serval::set16(-INFINITY);
  for (int64_t j = j0; j < tiles; ++j) top = serval::max16(top, serval::load16(scores + j * kKeys));
  const V16 max = serval::set16(serval::reduce_max16(top));
  V16 sums = serval::zero16();
  for (int64_t j = j0; j < tiles; ++j) {
    const V16 e = serval::first_lanes(serval::exp_nonpositive16(serval::sub16(serval::load16(scores + j * kKeys), max)),
                                      ctx - j * kKeys, 0.f);
    serval::store16(scores + j * kKeys, e);
    sums = serval::add16(sums, e);
  }
  return 1.f / serval::reduce_add16(sums);
}

#if defined(__AVX512F__)
// 16 values of a cache row as float32 (exact for every cache dtype).
template <typename scalar_t>
inline __m512 load_float16(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}

#endif

// 16 values (float32, or a cache row's 16- or 32-bit floats, widened exactly) for weighted_values.
inline V16 load_values16(const float* p) { return serval::load16(p); }
#if defined(__AVX512F__)
template <typename scalar_t>
inline V16 load_values16(const scalar_t* p) { return {load_float16(p)}; }
#endif

// Value vectors of 16 (C) and query heads (H) that weighted_values takes side by side: H * C sums, C values and a
// weight in registers (AVX-512: 32 of them; AVX2: 16, a V16 two). A prefill tile takes up to kWideValueHeads heads
// of whole tokens at once (24 sums, 4 values and a weight: 29 of AVX-512's registers).
#if defined(__AVX512F__)
constexpr int kValueChunks = 4, kValueHeads = 4, kWideValueHeads = 6;
#else
constexpr int kValueChunks = 2, kValueHeads = 2, kWideValueHeads = 2;
#endif

// For each of H query heads h (weights p + h * p_stride, sums acc + h * acc_stride): acc[0 .. C * 16) += the sum
// over keys l0 <= l < l1, in order, of p[l] * v[l] (value_row(l): where key l's C * 16 values start). Each
// lane of each head is one float32 FMA chain in key order; the heads only share the loads of the values and run
// side by side, so that no chain waits on its own last FMA (one head's C chains did, at 3 of a decode's 4 cycles).
// The sums are float32 in memory between calls: cutting the keys into ranges changes no bit.
// Always inlined: left to itself, the compiler stopped inlining it into the decode path once the prefill tile
// took more instances, and a decode's attention ran 20% slower.
// With Ahead > 0, each key asks for the values of the key Ahead places on (the one-token path: its rows lie 16 per
// block and kv heads apart, a pattern the hardware prefetcher follows poorly); the arithmetic is the same.
template <int C, int H, int Ahead = 0, typename ValueRow>
__attribute__((always_inline)) inline void weighted_values(const float* p, int64_t p_stride, ValueRow value_row,
                                                           int64_t l0, int64_t l1, float* acc, int64_t acc_stride) {
  V16 sum[H][C];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < C; ++i) sum[h][i] = serval::load16(acc + h * acc_stride + i * 16);
  for (int64_t l = l0; l < l1; ++l) {
    if constexpr (Ahead > 0)
      if (l + Ahead < l1) {
        const char* next = reinterpret_cast<const char*>(value_row(l + Ahead));
        for (size_t b = 0; b < C * 16 * sizeof(*value_row(l)); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
      }
    const auto* v = value_row(l);
    V16 values[C];
    for (int i = 0; i < C; ++i) values[i] = load_values16(v + i * 16);
    for (int h = 0; h < H; ++h) {
      const V16 ph = serval::set16(p[h * p_stride + l]);
      for (int i = 0; i < C; ++i) sum[h][i] = serval::fma16(ph, values[i], sum[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < C; ++i) serval::store16(acc + h * acc_stride + i * 16, sum[h][i]);
}

// weighted_values for ``heads`` (1 .. kValueHeads) heads.
template <int C, int Ahead = 0, typename ValueRow>
inline void weighted_values_of(int64_t heads, const float* p, int64_t p_stride, ValueRow value_row, int64_t l0,
                               int64_t l1, float* acc, int64_t acc_stride) {
  if constexpr (kValueHeads >= 4)
    if (heads == 4) return weighted_values<C, 4, Ahead>(p, p_stride, value_row, l0, l1, acc, acc_stride);
  if constexpr (kValueHeads >= 3)
    if (heads == 3) return weighted_values<C, 3, Ahead>(p, p_stride, value_row, l0, l1, acc, acc_stride);
  if (heads == 2) return weighted_values<C, 2, Ahead>(p, p_stride, value_row, l0, l1, acc, acc_stride);
  weighted_values<C, 1, Ahead>(p, p_stride, value_row, l0, l1, acc, acc_stride);
}

// weighted_values for ``heads`` (1 .. kWideValueHeads) heads: a prefill tile's heads of whole tokens.
template <int C, typename ValueRow>
inline void weighted_values_wide_of(int64_t heads, const float* p, int64_t p_stride, ValueRow value_row, int64_t l0,
                                    int64_t l1, float* acc, int64_t acc_stride) {
  if constexpr (kWideValueHeads >= 6) {
    if (heads == 6) return weighted_values<C, 6>(p, p_stride, value_row, l0, l1, acc, acc_stride);
    if (heads == 5) return weighted_values<C, 5>(p, p_stride, value_row, l0, l1, acc, acc_stride);
  }
  weighted_values_of<C>(heads, p, p_stride, value_row, l0, l1, acc, acc_stride);
}

#if defined(__AVX512F__)
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load_float16(src + i));
}

// Values d0 .. d0 + 16 of a cache row as float32 (code * scale for 8-bit rows).
template <typename Rows>
inline __m512 load_row16(const typename Rows::storage* row, int64_t d0, int64_t head_dim) {
  if constexpr (Rows::extra == 0) {
    return load_float16(row + d0);
  } else {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d0)));
    return _mm512_mul_ps(_mm512_i32gather_ps(codes, Rows::table(), 4), _mm512_set1_ps(row_scale<Rows>(row, head_dim)));
  }
}

template <typename Rows>
inline void row_to_float(const typename Rows::storage* row, float* dst, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 16) _mm512_storeu_ps(dst + i, load_row16<Rows>(row, i, head_dim));
}

// r[i] (row i, 16 columns) becomes column i: unpacks of 32- then 64-bit pairs within 128-bit lanes, then two
// rounds of 128-bit lane shuffles.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
    const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int half = 0; half < 16; half += 8)
    for (int i = 0; i < 4; ++i) {
      t[half + i] = _mm512_shuffle_f32x4(r[half + i], r[half + 4 + i], 0x88);
      t[half + 4 + i] = _mm512_shuffle_f32x4(r[half + i], r[half + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// Keys first .. first + 16 of one head (rows ``key(l)``; past ``count`` zeros) into kt tile [head_dim][16].
template <typename Rows, typename KeyRow>
inline void transpose_keys(KeyRow key, int64_t count, int64_t head_dim, float* tile) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = i < count ? load_row16<Rows>(key(i), d0, head_dim) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + (d0 + i) * kKeys, r[i]);
  }
}
#else
// 8 values of a cache row as float32 (exact for every cache dtype).
template <typename scalar_t>
inline __m256 load_float8(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(src);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
}

template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load_float8(src + i));
}

// Values d0 .. d0 + 8 of a cache row as float32 (code * scale for 8-bit rows).
template <typename Rows>
inline __m256 load_row8(const typename Rows::storage* row, int64_t d0, int64_t head_dim) {
  if constexpr (Rows::extra == 0) {
    return load_float8(row + d0);
  } else {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d0)));
    return _mm256_mul_ps(_mm256_i32gather_ps(Rows::table(), codes, 4), _mm256_set1_ps(row_scale<Rows>(row, head_dim)));
  }
}

template <typename Rows>
inline void row_to_float(const typename Rows::storage* row, float* dst, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(dst + i, load_row8<Rows>(row, i, head_dim));
}

// r[i] (row i, 8 columns) becomes column i.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// As the AVX-512 version: keys first .. first + 16 into kt tile [head_dim][16], in blocks of 8 keys x 8 dims.
template <typename Rows, typename KeyRow>
inline void transpose_keys(KeyRow key, int64_t count, int64_t head_dim, float* tile) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 8)
    for (int64_t k0 = 0; k0 < 16; k0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i)
        r[i] = k0 + i < count ? load_row8<Rows>(key(k0 + i), d0, head_dim) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(tile + (d0 + i) * kKeys + k0, r[i]);
    }
}
#endif

#if defined(__AVX512F__)
#define SERVAL_ONE_TOKEN_ATTENTION 1
// 16 bfloat16 key rows' dims d0 .. d0 + 16 (rows[i] + d0, 32 bytes each) as 8 vectors of 32-bit words, vector m's
// lane i holding key i's dims d0 + 2m (low half) and d0 + 2m + 1 (high half): a float32 is its bfloat16 shifted up 16
// bits, so dim d0 + 2m is the word << 16 and dim d0 + 2m + 1 the word's high half, exact. Two rows a register, then
// three rounds of shuffles: 32 shuffles where transpose16 and the widening take 80, on the one port that runs them on
// an Intel Xeon (benchmarks/README.md, "Decode attention at a context").
inline void bf16_key_pairs(const uint16_t* const (&rows)[16], int64_t d0, __m512i (&pairs)[8]) {
  __m512i z[8], a[8], b[8];
  const auto row = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + d0)); };
  for (int i = 0; i < 4; ++i) {  // register i: keys i and 4 + i; register 4 + i: keys 8 + i and 12 + i
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row(i)), row(4 + i), 1);
    z[4 + i] = _mm512_inserti64x4(_mm512_castsi256_si512(row(8 + i)), row(12 + i), 1);
  }
  for (int g = 0; g < 8; g += 4) {  // in each 128-bit lane, 4 keys' words m and m + 4
    a[g] = _mm512_unpacklo_epi32(z[g], z[g + 1]);
    a[g + 1] = _mm512_unpackhi_epi32(z[g], z[g + 1]);
    a[g + 2] = _mm512_unpacklo_epi32(z[g + 2], z[g + 3]);
    a[g + 3] = _mm512_unpackhi_epi32(z[g + 2], z[g + 3]);
    b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
    b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
    b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
    b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // lanes 0 and 2 of b[m] and b[4 + m] hold word m, lanes 1 and 3 word 4 + m
    pairs[m] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88);
    pairs[4 + m] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xdd);
  }
}

constexpr int kValuesAhead = 16;  // keys ahead whose values the one-token path asks for (measured 8-32 alike)

// attend_tiled's arithmetic for a tile of one query token (a decode), to the bit, without its float32 copies of the
// keys and values: each 16-key tile is transposed into registers and scored there by up to kValueHeads of the
// token's query heads (each lane the same FMA chain over the head dimension in order, from the same floats), and
// the values are widened as they are summed (exactly). For 16- and 32-bit float cache rows.
template <typename scalar_t, typename Rows, int DV>
void attend_one_token(const Inputs<scalar_t, Rows>& in, int64_t t, int64_t kvh) {
  constexpr int64_t head_dim = DV * 16;
  const int64_t group = in.group, ctx = in.lens[t], first = in.first_key(ctx);
  const int64_t* table = in.tables + in.rows[t] * in.max_blocks;
  const int64_t key_tiles = (ctx + kKeys - 1) / kKeys, tile_min = first / kKeys, stride = key_tiles * kKeys;
  float* qs = serval::scratch(2, group * (2 * head_dim + 1));
  float* acc = qs + group * head_dim;
  float* inv_sums = acc + group * head_dim;
  float* scores = serval::scratch(3, group * stride);
  int64_t* offsets = serval::scratch_index(ctx);
  for (int64_t l = tile_min * kKeys, block = l / in.block_size, within = l % in.block_size; l < ctx; ++l) {
    offsets[l] = ((table[block] * in.block_size + within) * in.num_kv_heads + kvh) * head_dim;
    if (++within == in.block_size) within = 0, ++block;
  }
  for (int64_t g = 0; g < group; ++g)
    to_float(in.q + (t * in.num_heads + kvh * group + g) * head_dim, qs + g * head_dim, head_dim);
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  static constexpr uint16_t kZeroRow[head_dim] = {};  // a key past the context: zeros, as transpose16 is given
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t h0 = 0; h0 < group; h0 += kValueHeads) {
    const int64_t heads = std::min<int64_t>(kValueHeads, group - h0);
    for (int64_t j = tile_min; j < key_tiles; ++j) {
      const int64_t count = std::min<int64_t>(kKeys, ctx - j * kKeys);
      // The next tile's keys, asked for while this one computes (1.2-1.3x at 3,000 keys from L3; see bf16_key_pairs).
      for (int64_t i = (j + 1) * kKeys; i < std::min<int64_t>((j + 2) * kKeys, ctx); ++i)
        for (size_t b = 0; b < head_dim * sizeof(scalar_t); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(in.kc + offsets[i]) + b, _MM_HINT_T0);
      __m512 sums[kValueHeads];
      for (int h = 0; h < kValueHeads; ++h) sums[h] = _mm512_setzero_ps();
      const auto add_dim = [&](int64_t d, __m512 keys) {
        for (int h = 0; h < kValueHeads; ++h)
          if (h < heads) sums[h] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(h0 + h) * head_dim + d]), keys, sums[h]);
      };
      if constexpr (kBf16) {
        const uint16_t* rows[16];
        for (int64_t i = 0; i < 16; ++i)
          rows[i] = i < count ? reinterpret_cast<const uint16_t*>(in.kc + offsets[j * kKeys + i]) : kZeroRow;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
          __m512i pairs[8];
          bf16_key_pairs(rows, d0, pairs);
          for (int m = 0; m < 8; ++m) {  // dims in order, as transpose16's columns
            add_dim(d0 + 2 * m, _mm512_castsi512_ps(_mm512_slli_epi32(pairs[m], 16)));
            add_dim(d0 + 2 * m + 1, _mm512_castsi512_ps(_mm512_and_si512(pairs[m], high_halves)));
          }
        }
      } else {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
          __m512 r[16];
          for (int64_t i = 0; i < 16; ++i)
            r[i] = i < count ? load_row16<Rows>(in.kc + offsets[j * kKeys + i], d0, head_dim) : _mm512_setzero_ps();
          transpose16(r);
          for (int i = 0; i < 16; ++i) add_dim(d0 + i, r[i]);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        V16 score = serval::mul16({sums[h]}, serval::set16(in.scale));
        if (in.softcap > 0.f)
          score = serval::mul16(serval::tanh16(serval::div16(score, serval::set16(in.softcap))),
                                serval::set16(in.softcap));
        serval::store16(scores + (h0 + h) * stride + j * kKeys, serval::first_lanes(score, count, -INFINITY));
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * stride;
    std::fill(sg + tile_min * kKeys, sg + first, -INFINITY);  // outside the window: exp gives 0
    inv_sums[g] = softmax_numerators(sg, tile_min, ctx);
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t h = 0; h < group; h += kValueHeads)
    for (int c = 0; c < DV; c += kValueChunks)
      weighted_values_of<kValueChunks, kValuesAhead>(std::min<int64_t>(kValueHeads, group - h), scores + h * stride,
                                                     stride, [&](int64_t l) { return in.vc + offsets[l] + c * 16; },
                                                     first, ctx, acc + h * head_dim + c * 16, head_dim);
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* dst = in.o + (t * in.num_heads + kvh * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv_sums[g]);
  }
}
#endif

template <typename scalar_t, typename Rows, int DV>
void attend_tiled(const Inputs<scalar_t, Rows>& in) {
  constexpr int64_t head_dim = DV * 16;
  const auto [num_tokens, num_heads, unused_head_dim, block_size, num_kv_heads, group, max_blocks, q, kc, vc, tables,
              rows, lens, o, fscale, window, softcap] = in;

  // Work items: up to kQueryTile consecutive tokens of one sequence, for one key/value head.
  std::vector<int64_t> tile_starts;
  for (int64_t t = 0; t < num_tokens;) {
    tile_starts.push_back(t);
    const int64_t first = t;
    while (++t < num_tokens && t - first < kQueryTile && rows[t] == rows[first]) {}
  }
  tile_starts.push_back(num_tokens);
  const int64_t num_tiles = static_cast<int64_t>(tile_starts.size()) - 1;

  // One task at a time: a prefill chunk's later tiles have longer contexts than its first ones.
  serval::parallel_chunks(0, num_tiles * num_kv_heads, 1, [&](int64_t first_task, int64_t end_task) {
    for (int64_t task = first_task; task < end_task; ++task) {
      const int64_t t0 = tile_starts[task / num_kv_heads], t1 = tile_starts[task / num_kv_heads + 1];
      const int64_t kvh = task % num_kv_heads;
  #if defined(SERVAL_ONE_TOKEN_ATTENTION)
      if constexpr (Rows::extra == 0) {
        if (t1 - t0 == 1) {
          attend_one_token<scalar_t, Rows, DV>(in, t0, kvh);
          continue;
        }
      }
  #endif
      const int64_t* table = tables + rows[t0] * max_blocks;
      int64_t ctx_max = 0, first_min = INT64_MAX;
      for (int64_t t = t0; t < t1; ++t) {
        ctx_max = std::max(ctx_max, lens[t]);
        first_min = std::min(first_min, in.first_key(lens[t]));
      }
      const int64_t key_tiles = (ctx_max + kKeys - 1) / kKeys;
      const int64_t tile_min = first_min / kKeys;  // keys before this tile are no query's
      float* kt = serval::scratch(0, key_tiles * kKeys * head_dim);
      // A float32 cache's values are read where they are; other rows are converted once for all the tile's heads.
      constexpr bool kFloatRows = std::is_same_v<typename Rows::storage, float> && Rows::extra == 0;
      float* v = kFloatRows ? nullptr : serval::scratch(1, ctx_max * head_dim);
      const int64_t nq = (t1 - t0) * group;  // the tile's query heads
      float* qs = serval::scratch(2, nq * (2 * head_dim + 1));
      float* acc = qs + nq * head_dim;
      float* inv_sums = acc + nq * head_dim;
      float* scores = serval::scratch(3, nq * key_tiles * kKeys);
      // Each key's row offset, found once: a division by the block size per key and per use cost more than the
      // arithmetic on the row.
      int64_t* offsets = serval::scratch_index(ctx_max);
      for (int64_t l = tile_min * kKeys, block = l / block_size, within = l % block_size; l < ctx_max; ++l) {
        offsets[l] = ((table[block] * block_size + within) * num_kv_heads + kvh) * (head_dim + Rows::extra);
        if (++within == block_size) within = 0, ++block;
      }
      for (int64_t j = tile_min; j < key_tiles; ++j)
        transpose_keys<Rows>([&](int64_t i) { return kc + offsets[j * kKeys + i]; },
                             std::min<int64_t>(kKeys, ctx_max - j * kKeys), head_dim, kt + j * kKeys * head_dim);
      if constexpr (!kFloatRows)
        for (int64_t l = tile_min * kKeys; l < ctx_max; ++l) row_to_float<Rows>(vc + offsets[l], v + l * head_dim, head_dim);
      // Every query head of the tile (tokens t0 .. t1, the group's heads) goes over the keys a block at a time, so a
      // block's keys and values are read from cache by all of them (a whole 8k context is 2 MB a head, past L2).
      const int64_t stride = key_tiles * kKeys;
      for (int64_t i = 0; i < nq; ++i)
        to_float(q + ((t0 + i / group) * num_heads + kvh * group + i % group) * head_dim, qs + i * head_dim, head_dim);
      const auto ctx_of = [&](int64_t i) { return lens[t0 + i / group]; };
      const auto first_of = [&](int64_t i) { return in.first_key(ctx_of(i)); };
      for (int64_t b0 = tile_min; b0 < key_tiles; b0 += kBlockTiles)
        for (int64_t i = 0; i < nq; i += group) {  // a token's query heads share its keys, context and window
          const int64_t j0 = std::max(b0, first_of(i) / kKeys);
          const int64_t j1 = std::min(b0 + kBlockTiles, (ctx_of(i) + kKeys - 1) / kKeys);
          if (j0 >= j1) continue;
          if (softcap > 0.f)
            score_heads<true>(group, qs + i * head_dim, kt, head_dim, j0, j1, ctx_of(i), fscale, softcap,
                              scores + i * stride, stride);
          else
            score_heads<false>(group, qs + i * head_dim, kt, head_dim, j0, j1, ctx_of(i), fscale, 0.f,
                               scores + i * stride, stride);
        }
      for (int64_t i = 0; i < nq; ++i) {
        float* s = scores + i * stride;
        std::fill(s + first_of(i) / kKeys * kKeys, s + first_of(i), -INFINITY);  // outside the window: exp gives 0
        inv_sums[i] = softmax_numerators(s, first_of(i) / kKeys, ctx_of(i));
        std::fill(acc + i * head_dim, acc + (i + 1) * head_dim, 0.f);
      }
      // Query heads i .. i + heads (consecutive: one token's, or whole tokens') over keys from .. l1, sharing the
      // loads of the values, up to ``most`` at a time.
      const auto sum_values = [&](int64_t i, int64_t heads, int64_t from, int64_t l1, int64_t most) {
        for (int64_t h = 0; from < l1 && h < heads; h += most)
          for (int c = 0; c < DV; c += kValueChunks) {
            const int64_t n = std::min<int64_t>(most, heads - h);
            float* out = acc + (i + h) * head_dim + c * 16;
            if constexpr (kFloatRows)
              weighted_values_wide_of<kValueChunks>(n, scores + (i + h) * stride, stride,
                                                    [&](int64_t l) { return vc + offsets[l] + c * 16; }, from, l1,
                                                    out, head_dim);
            else
              weighted_values_wide_of<kValueChunks>(n, scores + (i + h) * stride, stride,
                                                    [&](int64_t l) { return v + l * head_dim + c * 16; }, from, l1,
                                                    out, head_dim);
          }
      };
      // Tokens whose heads fit side by side go together over the keys of the block that they all attend to; each
      // token's keys before and after those are summed on its own, before and after, so every sum stays in key order.
      const int64_t tile_tokens = t1 - t0, tokens_together = std::max<int64_t>(1, kWideValueHeads / group);
      for (int64_t l0 = tile_min * kKeys; l0 < ctx_max; l0 += kBlockKeys)
        for (int64_t u0 = 0; u0 < tile_tokens; u0 += tokens_together) {
          const int64_t u1 = std::min(tile_tokens, u0 + tokens_together);
          const auto from_of = [&](int64_t u) { return std::max(l0, first_of(u * group)); };
          const auto to_of = [&](int64_t u) { return std::min(l0 + kBlockKeys, ctx_of(u * group)); };
          int64_t common_from = l0, common_to = l0 + kBlockKeys;
          for (int64_t u = u0; u < u1; ++u)
            common_from = std::max(common_from, from_of(u)), common_to = std::min(common_to, to_of(u));
          if (u1 - u0 == 1 || common_from >= common_to) {
            for (int64_t u = u0; u < u1; ++u) sum_values(u * group, group, from_of(u), to_of(u), kValueHeads);
            continue;
          }
          for (int64_t u = u0; u < u1; ++u) sum_values(u * group, group, from_of(u), common_from, kValueHeads);
          sum_values(u0 * group, (u1 - u0) * group, common_from, common_to, kWideValueHeads);
          for (int64_t u = u0; u < u1; ++u) sum_values(u * group, group, common_to, to_of(u), kValueHeads);
        }
      for (int64_t i = 0; i < nq; ++i) {
        scalar_t* dst = o + ((t0 + i / group) * num_heads + kvh * group + i % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i * head_dim + d] * inv_sums[i]);
      }
    }
  });
}
#endif


template <typename scalar_t, typename Rows>
void attend_any(const Inputs<scalar_t, Rows>& in) {
#if defined(SERVAL_TILED_ATTENTION)
  if (in.head_dim == 64) return attend_tiled<scalar_t, Rows, 4>(in);
  if (in.head_dim == 128) return attend_tiled<scalar_t, Rows, 8>(in);
  if (in.head_dim == 256) return attend_tiled<scalar_t, Rows, 16>(in);
#endif
  attend<scalar_t, Rows>(in);
}

template <typename Rows, typename scalar_t>
void quantize_rows(const scalar_t* x, uint8_t* cache, const int64_t* slots, int64_t num_rows, int64_t num_kv_heads,
                   int64_t head_dim) {
  serval::parallel_for(0, num_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // row r: token r / num_kv_heads, head r % num_kv_heads
      const scalar_t* src = x + r * head_dim;
      uint8_t* dst = cache + (slots[r / num_kv_heads] * num_kv_heads + r % num_kv_heads) * (head_dim + 4);
      float amax = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(src[d])));
      const float scale = amax > 0.f ? amax / Rows::max_code() : 1.f;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = Rows::encode(static_cast<float>(src[d]) / scale);
      std::memcpy(dst + head_dim, &scale, sizeof(float));
    }
  });
}

}  // namespace

// query [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] in the query's dtype, or [.., KVH, D + 4] 8-bit
// rows (int8, float8_e4m3fn, float8_e5m2: D codes and a float32 scale); block_tables [S, max_blocks];
// token_table [T]: each query's row in block_tables; context_lens [T]: keys each query attends to (a prefix, or
// with window > 0 its last window keys); softcap > 0: each scaled score s becomes softcap * tanh(s / softcap).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& token_table,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_table.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(softcap >= 0, "softcap is 0 (none) or positive");
  const auto codes = k_cache.scalar_type();
  const bool scaled = codes == at::kChar || codes == at::kFloat8_e4m3fn || codes == at::kFloat8_e5m2;
  TORCH_CHECK(scaled ? k_cache.size(3) == query.size(2) + 4 : codes == query.scalar_type(),
              "the cache holds rows of the query's dtype, or 8-bit rows of head_dim codes and a float32 scale");
  auto tables = block_tables.contiguous(), rows = token_table.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (codes == at::kChar)
      return attend_any(Inputs<scalar_t, ScaledRows<int8_t>>(query, k_cache, v_cache, tables, rows, lens, scale, window,
                                                             softcap, out));
    if (codes == at::kFloat8_e4m3fn)
      return attend_any(Inputs<scalar_t, ScaledRows<c10::Float8_e4m3fn>>(query, k_cache, v_cache, tables, rows, lens,
                                                                         scale, window, softcap, out));
    if (codes == at::kFloat8_e5m2)
      return attend_any(Inputs<scalar_t, ScaledRows<c10::Float8_e5m2>>(query, k_cache, v_cache, tables, rows, lens,
                                                                       scale, window, softcap, out));
    attend_any(Inputs<scalar_t, PlainRows<scalar_t>>(query, k_cache, v_cache, tables, rows, lens, scale, window, softcap,
                                                     out));
  });
  return out;
}

// Writes each token's keys k [T, KVH, D] and values v into the float rows of k_cache and v_cache
// [num_blocks, block_size, KVH, D] (the same dtype) at the slots slot_mapping [T]: one call for both, where two
// index_copy_ calls cost more than the copying at a few tokens a step. A token's KVH x D values must be contiguous
// (k and v may be views of the fused q/k/v projection, tokens apart by its width).
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong, "inputs");
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) * x->size(2) == width && x->stride(2) == 1 &&
                    x->stride(1) == x->size(2) && x->scalar_type() == k_cache.scalar_type(),
                "keys and values [T, KVH, D] in the cache's dtype, each token's rows contiguous");
  }
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) * k_cache.size(3) == width &&
                  v_cache.sizes() == k_cache.sizes() && slot_mapping.numel() == tokens, "caches [.., KVH, D]");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), bytes = width * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache");
    std::memcpy(kc + slot[t] * bytes, ks + t * k_stride, bytes);
    std::memcpy(vc + slot[t] * bytes, vs + t * v_stride, bytes);
  }
}

// Writes x [T, KVH, D] (each token's keys or values) into the 8-bit rows [num_blocks, block_size, KVH, D + 4] of
// cache at the slots slot_mapping [T]: per row, scale = max |x| / the code's largest value, codes = x / scale
// (rounded to nearest even), then the scale.
void quantize_kv_(const at::Tensor& x, at::Tensor cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(x.is_contiguous() && cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong, "inputs");
  const int64_t num_kv_heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(cache.size(3) == head_dim + 4 && cache.size(2) == num_kv_heads, "8-bit rows of D codes and a scale");
  const auto slots = slot_mapping.contiguous();
  auto* dst = static_cast<uint8_t*>(cache.data_ptr());
  const auto codes = cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_kv_", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const int64_t n = x.size(0) * num_kv_heads;
    if (codes == at::kChar)
      quantize_rows<ScaledRows<int8_t>>(src, dst, slots.data_ptr<int64_t>(), n, num_kv_heads, head_dim);
    else if (codes == at::kFloat8_e4m3fn)
      quantize_rows<ScaledRows<c10::Float8_e4m3fn>>(src, dst, slots.data_ptr<int64_t>(), n, num_kv_heads, head_dim);
    else if (codes == at::kFloat8_e5m2)
      quantize_rows<ScaledRows<c10::Float8_e5m2>>(src, dst, slots.data_ptr<int64_t>(), n, num_kv_heads, head_dim);
    else
      TORCH_CHECK(false, "quantize_kv_: the cache must be int8, float8_e4m3fn or float8_e5m2");
  });
}
