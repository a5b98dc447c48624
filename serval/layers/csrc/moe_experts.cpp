// The experts of a sparse mixture-of-experts layer (layers/moe.py) in one call, for weights laid out for the dense
// kernel (W^T per expert). The layer's PyTorch path pays a dozen aten calls a layer to group the (token, slot)
// pairs by expert and, per expert, a slice, two kernel calls, the activation, a cast, a multiply and the Python
// between them: at 16 decode rows over 8 experts that was half the layer's time, the kernels the other half.
// Here the grouping is a counting sort and each expert's rows go to the same kernels (panel_linear.cpp's
// dense_panel_linear, bf16_rows.cpp's silu_and_mul_v16) with the same roundings: the slots are the PyTorch path's
// bits. Each row is multiplied alone by those kernels, so a row's slots never depend on the rows beside it.
#include <torch/extension.h>

#include <cstring>
#include <vector>

at::Tensor dense_panel_linear(const at::Tensor& x, const at::Tensor& weight_t, bool float_output);
at::Tensor silu_and_mul_v16(const at::Tensor& x);

namespace {

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
    const at::Tensor y = dense_panel_linear(silu_and_mul_v16(dense_panel_linear(rows, gate_up_t[e], false)),
                                            down_t[e], false);
    if (y.scalar_type() == at::kBFloat16)
      weighted_rows(y.data_ptr<at::BFloat16>(), rows_order, wc.data_ptr<float>(), n, H, slots.data_ptr<float>());
    else
      weighted_rows(y.data_ptr<float>(), rows_order, wc.data_ptr<float>(), n, H, slots.data_ptr<float>());
  }
  return slots;
}
