// The GGUF block formats of the panel layout (BlockWeight.format in linear.py), shared by the float32 kernel
// (panel_linear.cpp) and the int8-activation kernel (int8_linear.cpp): their names, the shape of their panel bytes
// and scales, and the one check of a call's arguments. The layout itself is described in panel_linear.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace serval_blocks {

constexpr int64_t kBlock = 32;  // input positions per block

// Each block holds 32 input positions of 16 columns. kBF16 and kF32 are panel_linear.cpp's dense weights (no blocks,
// no name: dense_panel_linear takes them).
enum Format : int { kQ8, kQ4, kQ5, kQ4F, kQ5F, kQ6F, kQ4K, kQ5K, kQ6K, kBF16, kF32 };
constexpr int kFormats = 9;  // the block formats, named by format_index
// Bits above the nibble (5- and 6-bit codes), in bit-plane rows after the 16 nibble rows.
constexpr int extra_bits(int f) { return f == kQ5 || f == kQ5F || f == kQ5K ? 1 : f == kQ6F || f == kQ6K ? 2 : 0; }
constexpr bool half_scales(int f) { return f == kQ8 || f == kQ4 || f == kQ5; }
constexpr bool k_scales(int f) { return f == kQ4K || f == kQ5K || f == kQ6K; }  // the file's K-quant scales
constexpr bool sub_blocks_of_16(int f) { return f == kQ6F || f == kQ6K; }  // a scale per 16 positions, w = d (q - 32)
constexpr int block_rows(int f) { return f == kQ8 ? 32 : 16 + 4 * extra_bits(f); }
constexpr int scale_rows(int f) { return f == kQ8 ? 1 : 2; }  // per block: rows of 16 scales (K formats: of bytes)
constexpr int64_t kSuperBlocks = 8;  // blocks of 32 per K-quant super-block
constexpr int super_rows(int f) { return f == kQ6K ? 1 : 2; }  // float16 rows of 16 per super-block: d (, -dmin)
constexpr int64_t super_bytes(int f) { return super_rows(f) * 32 + kSuperBlocks * scale_rows(f) * 16; }

inline int format_index(const std::string& name) {
  static const char* const names[kFormats] = {"q8", "q4", "q5", "q4f", "q5f", "q6f", "q4k", "q5k", "q6k"};
  for (int f = 0; f < kFormats; ++f)
    if (name == names[f]) return f;
  TORCH_CHECK(false, "unknown block format ", name, " (q8, q4, q5, q4f, q5f, q6f, q4k, q5k, q6k)");
  return -1;
}

// A block linear's call: x [M, K]; panels uint8 [P (even), G, block_rows, 16] covering out_features columns and K
// inputs; scales as the format keeps them (panel_linear.cpp). Checks them once, for both kernels.
struct BlockCall {
  int format;
  int64_t rows, in_features, out_features, groups;
};

inline BlockCall check_block_call(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                  const std::string& format, int64_t out_features) {
  const int f = format_index(format);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(2) == block_rows(f) && panels.size(3) == 16 && panels.size(0) % 2 == 0,
              "panels: uint8 [P (even), G, ", block_rows(f), ", 16] for ", format);
  const int64_t groups = panels.size(1);
  TORCH_CHECK(panels.size(0) * 16 >= out_features && groups * kBlock >= x.size(1), "panels must cover the weight");
  if (k_scales(f)) {
    TORCH_CHECK(groups % kSuperBlocks == 0 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                    scales.numel() == panels.size(0) * (groups / kSuperBlocks) * super_bytes(f),
                "scales: uint8 [P, G / 8, ", super_bytes(f), "] for ", format, " (G a multiple of 8)");
  } else {
    TORCH_CHECK(scales.scalar_type() == (half_scales(f) ? at::kHalf : at::kFloat) && scales.is_contiguous() &&
                    scales.numel() == panels.size(0) * groups * scale_rows(f) * 16,
                "scales: [P, G, ", scale_rows(f), ", 16] ", half_scales(f) ? "float16" : "float32", " for ", format);
  }
  return {f, x.size(0), x.size(1), out_features, groups};
}

}  // namespace serval_blocks
