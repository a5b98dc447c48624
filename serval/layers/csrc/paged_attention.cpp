// Paged attention on the CPU, one query token at a time, reading keys and values straight from the block cache.
//
// Each query's result depends only on its own query vector, its keys and values, and its context length: the
// loops for one query never look at another query, at padding, or at how the batch was cut into chunks. That
// makes greedy output independent of batching by construction. Scores, softmax and the weighted sum are float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

template <typename scalar_t>
void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& token_table, const at::Tensor& context_lens,
            double scale, at::Tensor& out) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* rows = token_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), kf(head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t ctx = lens[t];
      const int64_t* table = tables + rows[t] * max_blocks;
      scores.assign(group * ctx, 0.f);
      load_row(q + (t * num_heads + kvh * group) * head_dim, qf.data(), group * head_dim);
      for (int64_t l = 0; l < ctx; ++l) {  // scores, one key at a time, shared by the query heads of this group
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        load_row(kc + (slot * num_kv_heads + kvh) * head_dim, kf.data(), head_dim);
        for (int64_t g = 0; g < group; ++g)
          scores[g * ctx + l] = dot(qf.data() + g * head_dim, kf.data(), head_dim) * fscale;
      }
      std::vector<float> sums(group);
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators, in place
        float* s = scores.data() + g * ctx;
        const float max = *std::max_element(s, s + ctx);
        float sum = 0.f;
        for (int64_t l = 0; l < ctx; ++l) {
          s[l] = std::exp(s[l] - max);
          sum += s[l];
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < ctx; ++l) {  // the weighted sum of values, in key order
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        load_row(vc + (slot * num_kv_heads + kvh) * head_dim, kf.data(), head_dim);
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

}  // namespace

// query [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks];
// token_table [T]: each query's row in block_tables; context_lens [T]: keys each query attends to (a prefix).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& token_table,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_table.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong, "int64 tables");
  auto tables = block_tables.contiguous(), rows = token_table.contiguous(), lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(query, k_cache, v_cache, tables, rows, lens, scale, out);
  });
  return out;
}
