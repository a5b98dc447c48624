// The experts of a sparse mixture-of-experts layer (layers/moe.py) in one call, for weights laid out for the dense
// kernel (W^T per expert). The layer's PyTorch path pays a dozen aten calls a layer to group the (token, slot)
// pairs by expert and, per expert, a slice, two kernel calls, the activation, a cast, a multiply and the Python
// between them: at 16 decode rows over 8 experts that was half the layer's time, the kernels the other half.
// Here the grouping is a counting sort and each expert's rows go to the same kernels with the same roundings
// (panel_linear.cpp's dense_panel_linear, or below for few bfloat16 rows its arithmetic on a faster schedule;
// bf16_rows.cpp's silu_and_mul_v16): the slots are the PyTorch path's bits. Each row is multiplied alone, so a
// row's slots never depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SERVAL_MOE_FEW_ROWS 1
#endif

#include "kernels.h"

namespace {

#if defined(SERVAL_MOE_FEW_ROWS)
// An expert's few rows (a decode step gives each a k / experts share of its rows) times its bfloat16 W^T [K, N],
// with dense_panel_linear's arithmetic, so its bits: each output one float32 FMA chain over k in order from zero,
// rounded to bfloat16 as its store rounds. What differs is the schedule, 1.8x faster over a layer's 8 experts at
// 2-7 rows each (benchmarks/README.md): up to 7 rows in one pass over the weights; 64 or 128 columns at a time
// (8 to 28 accumulators, so that one row's FMA chains do not wait on each other); 32 weights widened by one shift
// and one mask (even columns are the low halves shifted up, odd ones the high halves; two accumulators interleaved
// back at the store), no shuffle; and walking down k, each row of W^T another page that the hardware does not
// prefetch, the rows 32 ahead prefetched (16 ran 1.1-1.3x the time, none 2.4x, 48-128 no faster). float32 weights
// gained nothing here (bound by memory already): they keep dense_panel_linear.
constexpr int64_t kFewRows = 7;
constexpr int64_t kAhead = 32;

// float32 to bfloat16 bits, rounding to nearest even and NaN to its quiet NaN, as panel_linear.cpp's store_out.
inline __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline __mmask16 first16(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1); }
inline void store16(float* y, __m512 v, int64_t n) { _mm512_mask_storeu_ps(y, first16(n), v); }
inline void store16(uint16_t* y, __m512 v, int64_t n) { _mm256_mask_storeu_epi16(y, first16(n), bf16_bits(v)); }

// R rows of x (float32, row stride K) times C chunks of 32 columns of W^T from column n0 (Tail: the last, past N
// masked) into y [R, N].
template <int R, int C, bool Tail, typename Out>
void column_block(const float* x, int64_t K, const uint16_t* w, int64_t N, int64_t n0, Out* y) {
  __m512 acc[R][2 * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_setzero_ps();
  __mmask32 mask[C];
  for (int c = 0; c < C; ++c) mask[c] = first32(N - n0 - 32 * c);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* p = w + n0;
  for (int64_t k = 0; k < K; ++k, p += N) {
    // The rows kAhead on, then the next block's first rows (this thread's next block, if it has one).
    const uint16_t* ahead = k + kAhead < K ? p + kAhead * N : n0 + 32 * C < N ? w + n0 + 32 * C + (k + kAhead - K) * N
                                                                                 : nullptr;
    if (ahead)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(ahead + 32 * c), _MM_HINT_T0);
    __m512 wk[2 * C];
    for (int c = 0; c < C; ++c) {
      const __m512i v = Tail ? _mm512_maskz_loadu_epi16(mask[c], p + 32 * c) : _mm512_loadu_si512(p + 32 * c);
      wk[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wk[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wk[c], acc[r][c]);
    }
  }
  const __m512i low_index = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high_index = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      Out* yr = y + r * N + n0 + 32 * c;
      const int64_t left = N - n0 - 32 * c;
      store16(yr, _mm512_permutex2var_ps(acc[r][2 * c], low_index, acc[r][2 * c + 1]), left);
      store16(yr + 16, _mm512_permutex2var_ps(acc[r][2 * c], high_index, acc[r][2 * c + 1]), left - 16);
    }
}

template <int R, int C, typename Out>
void column_blocks(const float* x, int64_t K, const uint16_t* w, int64_t N, Out* y) {
  const int64_t width = 32 * C;
  at::parallel_for(0, (N + width - 1) / width, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if ((b + 1) * width <= N) column_block<R, C, false, Out>(x, K, w, N, b * width, y);
      else column_block<R, C, true, Out>(x, K, w, N, b * width, y);
    }
  });
}

// x [M, K] float32 (M <= kFewRows) times W^T [K, N] bfloat16 into y [M, N].
template <typename Out>
void few_rows_linear(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, Out* y) {
  switch (M) {
    case 7: return column_blocks<7, 2, Out>(x, K, w, N, y);
    case 6: return column_blocks<6, 2, Out>(x, K, w, N, y);
    case 5: return column_blocks<5, 2, Out>(x, K, w, N, y);
    case 4: return column_blocks<4, 2, Out>(x, K, w, N, y);
    case 3: return column_blocks<3, 4, Out>(x, K, w, N, y);
    case 2: return column_blocks<2, 4, Out>(x, K, w, N, y);
    default: return column_blocks<1, 4, Out>(x, K, w, N, y);
  }
}
#endif

// x [M, K] times W^T [K, N] in x's dtype: dense_panel_linear's bits, by the few-row schedule where it applies.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight_t) {
#if defined(SERVAL_MOE_FEW_ROWS)
  const int64_t M = x.size(0), K = x.size(1), N = weight_t.size(1);
  if (M <= kFewRows && weight_t.scalar_type() == at::kBFloat16 && x.is_contiguous()) {
    thread_local std::vector<float> rows;
    rows.resize(M * K);
    if (x.scalar_type() == at::kBFloat16) {
      const at::BFloat16* src = x.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < M * K; ++i) rows[i] = static_cast<float>(src[i]);
    } else {
      std::memcpy(rows.data(), x.data_ptr<float>(), M * K * sizeof(float));
    }
    const uint16_t* w = reinterpret_cast<const uint16_t*>(weight_t.data_ptr<at::BFloat16>());
    at::Tensor y = at::empty({M, N}, x.options());
    if (x.scalar_type() == at::kBFloat16)
      few_rows_linear(rows.data(), M, K, w, N, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    else
      few_rows_linear(rows.data(), M, K, w, N, y.data_ptr<float>());
    return y;
  }
#endif
  return dense_panel_linear(x, weight_t, false);
}


// slots[s] = float(y[i]) * weight[s] for s = order[i]: the expert's output rounded to the model dtype (as the
// PyTorch path's matmul returns it), then weighted in float32.
template <typename T>
void weighted_rows(const T* y, const int64_t* order, const float* weights, int64_t rows, int64_t hidden,
                   float* slots) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t s = order[i];
    const float w = weights[s];
    const T* yr = y + i * hidden;
    float* out = slots + s * hidden;
    for (int64_t h = 0; h < hidden; ++h) out[h] = static_cast<float>(yr[h]) * w;
  }
}

}  // namespace

// x [T, H] (bfloat16 or float32) routed to ids [T, k] (int64, global expert ids) with weights [T, k] (float32).
// gate_up_t [E, H, 2 I] and down_t [E, I, H]: this rank's experts first_expert .. first_expert + E - 1, each W^T
// contiguous (gate columns first, then up). Returns the slots [T, k, H] float32: slot (t, j) is expert ids[t][j]'s
// output for row t times weights[t][j] where that expert is this rank's, else zero.
at::Tensor moe_expert_slots(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            const at::Tensor& gate_up_t, const at::Tensor& down_t, int64_t first_expert) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: [T, H] bfloat16 or float32");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, "ids: [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, "weights: [T, k] float32");
  TORCH_CHECK(gate_up_t.dim() == 3 && down_t.dim() == 3 && gate_up_t.is_contiguous() && down_t.is_contiguous(),
              "gate_up_t [E, H, 2I] and down_t [E, I, H], contiguous");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = gate_up_t.size(0);
  TORCH_CHECK(gate_up_t.size(1) == H && down_t.size(0) == E && down_t.size(2) == H &&
                  gate_up_t.size(2) == 2 * down_t.size(1),
              "gate_up_t [E, H, 2I] and down_t [E, I, H]");
  at::Tensor slots = at::zeros({T, k, H}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous(), idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();

  // The slots grouped by this rank's experts, in slot (so token) order within each: a counting sort.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t e = id[s] - first_expert;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(start[E]), next(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t e = id[s] - first_expert;
    if (e >= 0 && e < E) order[next[e]++] = s;
  }

  const int64_t row_bytes = H * xc.element_size();
  const uint8_t* xb = static_cast<const uint8_t*>(xc.data_ptr());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* rows_order = order.data() + start[e];
    at::Tensor rows = at::empty({n, H}, xc.options());
    uint8_t* rb = static_cast<uint8_t*>(rows.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(rb + i * row_bytes, xb + (rows_order[i] / k) * row_bytes, row_bytes);
    const at::Tensor y = linear_rows(silu_and_mul_v16(linear_rows(rows, gate_up_t[e])), down_t[e]);
    if (y.scalar_type() == at::kBFloat16)
      weighted_rows(y.data_ptr<at::BFloat16>(), rows_order, wc.data_ptr<float>(), n, H, slots.data_ptr<float>());
    else
      weighted_rows(y.data_ptr<float>(), rows_order, wc.data_ptr<float>(), n, H, slots.data_ptr<float>());
  }
  return slots;
}

// slots [T, k, H] float32 summed over k in slot order (each token's sum alone: the same bits whichever expert or
// rank filled each slot), rounded once to like's dtype: the PyTorch lines' slots[:, 0] + slots[:, 1] + ... then
// .to(dtype), in one pass.
at::Tensor moe_sum_slots(const at::Tensor& slots, const at::Tensor& like) {
  TORCH_CHECK(slots.dim() == 3 && slots.scalar_type() == at::kFloat && slots.size(1) > 0, "slots: [T, k, H] float32");
  TORCH_CHECK(like.scalar_type() == at::kBFloat16 || like.scalar_type() == at::kFloat, "like: bfloat16 or float32");
  const at::Tensor sc = slots.contiguous();
  const int64_t T = sc.size(0), k = sc.size(1), H = sc.size(2);
  at::Tensor out = at::empty({T, H}, like.options());
  const float* s = sc.data_ptr<float>();
  auto run = [&](auto* o) {
    using Out = std::remove_pointer_t<decltype(o)>;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* v = s + t * k * H + h;
        float total = v[0];
        for (int64_t j = 1; j < k; ++j) total += v[j * H];
        o[t * H + h] = static_cast<Out>(total);
      }
  };
  if (like.scalar_type() == at::kBFloat16) run(out.data_ptr<at::BFloat16>());
  else run(out.data_ptr<float>());
  return out;
}
