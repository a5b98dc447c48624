// Block re-layouts made once at load, each a single pass over the bytes with rows in parallel:
//   gguf_k_blocks: a GGUF file's K-quant super-blocks (Q4_K, Q5_K, Q6_K) as BlockWeight's blocks of 32 (codes packed
//     as model/gguf_file.py's _to_block_weight packs them, the file's scales as they are);
//   block_panels_: BlockWeight's blocks as the panels of 16 columns that panel_linear.cpp reads (linear.py's
//     BlockWeight.panels; the layout is described at the top of panel_linear.cpp);
//   gguf_k_panels_: the two in one pass for a GGUF K-quant matrix, a panel's 16 rows at a time through blocks
//     of 32 held in cache (a load's model/gguf_file.py FileKBlocks): 1.6 GB less memory traffic at 1B.
// Why: the same shuffles in PyTorch made several intermediate tensors a matrix and took most of a start (1B Q4_K_M:
// ~5 s of ~8; 8B: ~44 s). The bytes are the same as the PyTorch reference's
// (tests/layers/test_block_repack.py).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>
#if defined(__SSSE3__)
#include <immintrin.h>
#endif

namespace {

#if defined(__SSSE3__)
// Byte b of row c → byte c of row b, for 16 rows of 16 bytes: four rounds of interleaving (8, 16, 32, 64 bits).
inline void transpose_16x16(const __m128i in[16], __m128i out[16]) {
  __m128i s1[16], s2[16], s3[16];
  for (int i = 0; i < 8; i++) {  // s1[8 h + i]: rows 2 i, 2 i + 1; bytes 8 h to 8 h + 7
    s1[i] = _mm_unpacklo_epi8(in[2 * i], in[2 * i + 1]);
    s1[i + 8] = _mm_unpackhi_epi8(in[2 * i], in[2 * i + 1]);
  }
  for (int h = 0; h < 2; h++) {  // s2[4 m + i]: rows 4 i to 4 i + 3; bytes 4 m to 4 m + 3
    for (int i = 0; i < 4; i++) {
      s2[h * 8 + i] = _mm_unpacklo_epi16(s1[h * 8 + 2 * i], s1[h * 8 + 2 * i + 1]);
      s2[h * 8 + i + 4] = _mm_unpackhi_epi16(s1[h * 8 + 2 * i], s1[h * 8 + 2 * i + 1]);
    }
  }
  for (int m = 0; m < 4; m++) {  // s3[2 d + i]: rows 8 i to 8 i + 7; bytes 2 d, 2 d + 1
    for (int i = 0; i < 2; i++) {
      s3[m * 4 + i] = _mm_unpacklo_epi32(s2[m * 4 + 2 * i], s2[m * 4 + 2 * i + 1]);
      s3[m * 4 + i + 2] = _mm_unpackhi_epi32(s2[m * 4 + 2 * i], s2[m * 4 + 2 * i + 1]);
    }
  }
  for (int d = 0; d < 8; d++) {
    out[2 * d] = _mm_unpacklo_epi64(s3[2 * d], s3[2 * d + 1]);
    out[2 * d + 1] = _mm_unpackhi_epi64(s3[2 * d], s3[2 * d + 1]);
  }
}

// BlockWeight's 16 nibble bytes (byte i: codes i and i + 16) → a panel column's (byte i: codes 2 i and 2 i + 1).
inline __m128i nibble_pairs(__m128i b) {
  const __m128i evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m128i odds = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i e = _mm_shuffle_epi8(b, evens), o = _mm_shuffle_epi8(b, odds);
  const __m128i first = _mm_or_si128(_mm_and_si128(e, low), _mm_slli_epi16(_mm_and_si128(o, low), 4));
  const __m128i second = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(e, 4), low), _mm_andnot_si128(low, o));
  return _mm_unpacklo_epi64(first, second);
}
#endif

// A block's 32 codes (below 2^(4 + e)) in BlockWeight's packing: byte i of the first 16 holds code i (low nibble)
// and code i + 16 (high); then 4 e bytes of the bits above the nibbles, code k's at bit e (k % (8 / e)) of byte
// 16 + k / (8 / e).
inline void pack_codes(const uint8_t* q, int e, uint8_t* out) {
  for (int i = 0; i < 16; i++) out[i] = (q[i] & 15) | ((q[i + 16] & 15) << 4);
  if (e == 0) return;
  const int per_byte = 8 / e;
  for (int j = 0; j < 4 * e; j++) {
    uint8_t byte = 0;
    for (int i = 0; i < per_byte; i++) byte |= (q[j * per_byte + i] >> 4) << (e * i);
    out[16 + j] = byte;
  }
}

// Q4_K's and Q5_K's 12 bytes of 6-bit sub-block scales and mins → sub-block s's (sc, mn).
inline void k_scale_min(const uint8_t* b, int s, uint8_t* sc, uint8_t* mn) {
  if (s < 4) {
    *sc = b[s] & 63;
    *mn = b[s + 4] & 63;
  } else {
    *sc = (b[s + 4] & 15) | ((b[s - 4] >> 6) << 4);
    *mn = (b[s + 4] >> 4) | ((b[s] >> 6) << 4);
  }
}

int extra_bits(const std::string& format) {
  if (format == "q4" || format == "q4f" || format == "q4k") return 0;
  if (format == "q5" || format == "q5f" || format == "q5k") return 1;
  if (format == "q6f" || format == "q6k") return 2;
  TORCH_CHECK(false, "no block format ", format);
}

bool is_k_format(const std::string& format) { return format == "q4k" || format == "q5k" || format == "q6k"; }

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1, what,
              " must be a CPU tensor [rows, blocks, k] whose last dimension is contiguous");
}

// One row of a GGUF K-quant matrix (its super-blocks at src) as BlockWeight's blocks of 32: the codes packed
// (dst_packed, 16 + 4 e bytes a block), each block's two scale bytes (dst_scales: Q4_K, Q5_K sc and mn; Q6_K the
// int8 sc of its halves) and each super-block's float16 d (and -dmin) (dst_supers).
void k_row_blocks(const uint8_t* src, int64_t supers, int64_t bytes, int e, uint8_t* dst_packed, uint8_t* dst_scales,
                  uint16_t* dst_supers) {
  const int halves = e == 2 ? 1 : 2;
  const int64_t packed_bytes = 16 + 4 * e;
  uint8_t q[32];
  for (int64_t s = 0; s < supers; s++) {
    const uint8_t* b = src + s * bytes;
    const int64_t block0 = s * 8;
    uint16_t* supers_out = dst_supers + s * halves;
    if (e < 2) {  // d, dmin (float16), 12 bytes of scales and mins, [Q5_K: 32 bytes of fifth bits,] 128 of nibbles
      uint16_t d, dmin;
      std::memcpy(&d, b, 2);
      std::memcpy(&dmin, b + 2, 2);
      supers_out[0] = d;
      supers_out[1] = dmin ^ 0x8000;  // -dmin: the sign bit flipped, as float16 negation does
      const uint8_t* qs = b + bytes - 128;
#if defined(__SSSE3__)
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m128i qh0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
      const __m128i qh1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32));
      for (int sub = 0; sub < 8; sub++) {
        const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * (sub / 2)));
        const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * (sub / 2) + 16));
        const __m128i nibbles = sub % 2 == 0
            ? _mm_or_si128(_mm_and_si128(first, low), _mm_slli_epi16(_mm_and_si128(second, low), 4))
            : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(first, 4), low), _mm_andnot_si128(low, second));
        uint8_t* out = dst_packed + (block0 + sub) * packed_bytes;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), nibbles);
        if (e == 1) {  // bit s of byte 16 + i → bit i of the 32-bit little-endian word after the nibbles
          const uint32_t bits = static_cast<uint32_t>(_mm_movemask_epi8(_mm_slli_epi16(qh0, 7 - sub))) |
                                static_cast<uint32_t>(_mm_movemask_epi8(_mm_slli_epi16(qh1, 7 - sub))) << 16;
          std::memcpy(out + 16, &bits, 4);
        }
        k_scale_min(b + 4, sub, dst_scales + (block0 + sub) * 2, dst_scales + (block0 + sub) * 2 + 1);
      }
      continue;
#endif
      for (int sub = 0; sub < 8; sub++) {  // byte 32 j + i: weight i of sub-blocks 2 j (low nibble) and 2 j + 1
        const int shift = 4 * (sub % 2);
        for (int i = 0; i < 32; i++) q[i] = (qs[32 * (sub / 2) + i] >> shift) & 15;
        if (e == 1) {  // weight i of sub-block s: bit s of byte 16 + i
          for (int i = 0; i < 32; i++) q[i] |= ((b[16 + i] >> sub) & 1) << 4;
        }
        pack_codes(q, e, dst_packed + (block0 + sub) * packed_bytes);
        k_scale_min(b + 4, sub, dst_scales + (block0 + sub) * 2, dst_scales + (block0 + sub) * 2 + 1);
      }
    } else {  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16 d
      std::memcpy(dst_scales + block0 * 2, b + 192, 16);
      std::memcpy(supers_out, b + 208, 2);
#if defined(__SSSE3__)
      const __m128i low = _mm_set1_epi8(0x0F), two_bits = _mm_set1_epi8(3);
      const __m128i by_4 = _mm_setr_epi8(1, 4, 1, 4, 1, 4, 1, 4, 1, 4, 1, 4, 1, 4, 1, 4);
      const __m128i by_16 = _mm_setr_epi16(1, 16, 1, 16, 1, 16, 1, 16);
      for (int h = 0; h < 2; h++) {
        for (int quarter = 0; quarter < 4; quarter++) {  // weight 128 h + 32 quarter + i
          const uint8_t* ql = b + 64 * h + 32 * (quarter % 2);
          const uint8_t* qh = b + 128 + 32 * h;
          const int shift = 4 * (quarter / 2);
          const __m128i first = _mm_and_si128(
              _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql)), shift), low);
          const __m128i second = _mm_and_si128(
              _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16)), shift), low);
          uint8_t* out = dst_packed + (block0 + 4 * h + quarter) * packed_bytes;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_or_si128(first, _mm_slli_epi16(second, 4)));
          // the 2-bit pairs of codes 4 j to 4 j + 3 → byte 16 + j: x0 + 4 x1 + 16 x2 + 64 x3
          __m128i pairs[2];
          for (int half = 0; half < 2; half++) {
            const __m128i x = _mm_and_si128(
                _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * half)), 2 * quarter),
                two_bits);
            pairs[half] = _mm_madd_epi16(_mm_maddubs_epi16(x, by_4), by_16);
          }
          const __m128i words = _mm_packs_epi32(pairs[0], pairs[1]);
          _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 16), _mm_packus_epi16(words, words));
        }
      }
      continue;
#endif
      for (int h = 0; h < 2; h++) {
        for (int quarter = 0; quarter < 4; quarter++) {  // weight 128 h + 32 quarter + i
          const uint8_t* ql = b + 64 * h + 32 * (quarter % 2);
          const uint8_t* qh = b + 128 + 32 * h;
          const int shift = 4 * (quarter / 2);
          for (int i = 0; i < 32; i++) q[i] = ((ql[i] >> shift) & 15) | (((qh[i] >> (2 * quarter)) & 3) << 4);
          pack_codes(q, e, dst_packed + (block0 + 4 * h + quarter) * packed_bytes);
        }
      }
    }
  }
}

// Where block_panels_ reads a weight's blocks: rows [N, G, bytes] (packed), [N, G, k] (scales) and the K formats'
// [N, G / 8, h] (supers), each row at its stride; row r (r < n) of the weight at row r - row0 of these.
struct PanelSource {
  const uint8_t* src;
  const uint8_t* src_scales;
  const uint8_t* src_supers;
  int64_t stride0, stride1, scale_stride0, scale_stride1, super_stride0, super_stride1;
  int64_t n, row0, groups, nb, k, width, supers, halves, per_super;
  bool q8, k_format;
};

// Panel p (rows 16 p to 16 p + 15) of a weight, its bytes and scales written at dst and dst_scales (the panels'
// and panel scales' tensors, panel p at its offset).
void write_panel(const PanelSource& in, int64_t p, uint8_t* dst, uint8_t* dst_scales) {
  const uint8_t* src = in.src;
  const uint8_t* src_scales = in.src_scales;
  const uint8_t* src_supers = in.src_supers;
  const int64_t stride0 = in.stride0, stride1 = in.stride1, scale_stride0 = in.scale_stride0;
  const int64_t scale_stride1 = in.scale_stride1, super_stride0 = in.super_stride0, super_stride1 = in.super_stride1;
  const int64_t n = in.n, row0 = in.row0, groups = in.groups, nb = in.nb, k = in.k, width = in.width;
  const int64_t supers = in.supers, halves = in.halves, per_super = in.per_super;
  const bool q8 = in.q8, k_format = in.k_format;
  for (int64_t g = 0; g < groups; g++) {
    uint8_t* out = dst + (p * groups + g) * nb * 16;
#if defined(__SSSE3__)
    // 16 bytes of each of the 16 columns at a time, transposed: the first 16 (the nibbles, re-paired; q8's
    // first half), then the last 16, of which the bytes past the first 16 are kept
    __m128i columns[16], panel_rows[16];
    for (int64_t start : {int64_t{0}, nb - 16}) {
      for (int64_t c = 0; c < 16; c++) {
        const int64_t row = p * 16 + c;
        columns[c] = row < n ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (row - row0) * stride0 +
                                                                                g * stride1 + start))
                             : _mm_setzero_si128();
        if (start == 0 && !q8) columns[c] = nibble_pairs(columns[c]);
      }
      transpose_16x16(columns, panel_rows);
      for (int64_t b = start == 0 ? 0 : 32 - nb; b < 16; b++) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (start + b) * 16), panel_rows[b]);
      }
      if (nb == 16) break;
    }
#else
    for (int64_t c = 0; c < 16; c++) {
      const int64_t row = p * 16 + c;
      if (row >= n) {  // rows past the weight's: zero weights
        for (int64_t b = 0; b < nb; b++) out[b * 16 + c] = 0;
        continue;
      }
      const uint8_t* block = src + (row - row0) * stride0 + g * stride1;
      if (q8) {
        for (int64_t b = 0; b < nb; b++) out[b * 16 + c] = block[b];
        continue;
      }
      // code k: the low nibble of byte k for k < 16, the high nibble of byte k - 16 after; a panel's byte i
      // holds codes 2 i (low nibble) and 2 i + 1 (high); the high bits' bytes are the same
      for (int64_t i = 0; i < 8; i++) {
        out[i * 16 + c] = (block[2 * i] & 15) | ((block[2 * i + 1] & 15) << 4);
        out[(i + 8) * 16 + c] = (block[2 * i] >> 4) | (block[2 * i + 1] & 0xF0);
      }
      for (int64_t b = 16; b < nb; b++) out[b * 16 + c] = block[b];
    }
#endif
    if (k_format) continue;
    uint8_t* out_scales = dst_scales + (p * groups + g) * k * 16 * width;
    for (int64_t c = 0; c < 16; c++) {
      const int64_t row = p * 16 + c;
      for (int64_t j = 0; j < k; j++) {
        uint8_t* to = out_scales + (j * 16 + c) * width;
        if (row < n) {
          std::memcpy(to, src_scales + (row - row0) * scale_stride0 + g * scale_stride1 + j * width, width);
        } else {
          std::memset(to, 0, width);
        }
      }
    }
  }
  if (!k_format) return;
  for (int64_t s = 0; s < supers; s++) {  // per super-block: the columns' d (and -dmin), then the blocks' bytes
    uint8_t* out = dst_scales + (p * supers + s) * per_super;
    for (int64_t c = 0; c < 16; c++) {
      const int64_t row = p * 16 + c;
      for (int64_t j = 0; j < halves; j++) {
        uint8_t* to = out + (j * 16 + c) * 2;
        if (row < n) {
          std::memcpy(to, src_supers + (row - row0) * super_stride0 + s * super_stride1 + j * 2, 2);
        } else {
          to[0] = to[1] = 0;
        }
      }
      for (int64_t b = 0; b < 8; b++) {
        for (int64_t j = 0; j < 2; j++) {
          out[halves * 32 + (b * 2 + j) * 16 + c] =
              row < n ? src_scales[(row - row0) * scale_stride0 + (s * 8 + b) * scale_stride1 + j] : 0;
        }
      }
    }
  }
}

// The code bits above the nibbles (0, 1, 2) of a GGUF K-quant type, after checking its raw super-blocks [rows,
// super-blocks, bytes].
int k_quant_extra_bits(const at::Tensor& raw, const std::string& qtype) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 3 && raw.is_contiguous(),
              "raw must be contiguous uint8 [rows, super-blocks, bytes]");
  const int e = qtype == "Q4_K" ? 0 : qtype == "Q5_K" ? 1 : qtype == "Q6_K" ? 2 : -1;
  TORCH_CHECK(e >= 0, "K-quant blocks are Q4_K, Q5_K or Q6_K, not ", qtype);
  TORCH_CHECK(raw.size(2) == (e == 0 ? 144 : e == 1 ? 176 : 210), qtype, " blocks have another size than ",
              raw.size(2));
  return e;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_k_blocks(const at::Tensor& raw, const std::string& qtype) {
  const int e = k_quant_extra_bits(raw, qtype);
  const int64_t n = raw.size(0), supers = raw.size(1), bytes = raw.size(2);
  const int halves = e == 2 ? 1 : 2;
  at::Tensor packed = at::empty({n, supers * 8, 16 + 4 * e}, raw.options());
  at::Tensor scales = at::empty({n, supers * 8, 2}, raw.options().dtype(e == 2 ? at::kChar : at::kByte));
  at::Tensor super_scales = at::empty({n, supers, halves}, raw.options().dtype(at::kShort));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst_packed = packed.data_ptr<uint8_t>();
  uint8_t* dst_scales = static_cast<uint8_t*>(scales.data_ptr());
  uint16_t* dst_supers = reinterpret_cast<uint16_t*>(super_scales.data_ptr<int16_t>());
  const int64_t packed_bytes = 16 + 4 * e;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      k_row_blocks(src + r * supers * bytes, supers, bytes, e, dst_packed + r * supers * 8 * packed_bytes,
                   dst_scales + r * supers * 8 * 2, dst_supers + r * supers * halves);
  });
  return {packed, scales, super_scales};
}

void block_panels_(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& super_scales,
                   const std::string& format, at::Tensor panels, at::Tensor panel_scales) {
  check_rows(packed, "packed");
  check_rows(scales, "scales");
  TORCH_CHECK(packed.element_size() == 1 && panels.element_size() == 1, "packed and panels are bytes");
  const int64_t n = packed.size(0), groups = packed.size(1), nb = packed.size(2), k = scales.size(2);
  const int64_t p_count = panels.size(0);
  TORCH_CHECK(panels.is_contiguous() && panel_scales.is_contiguous(), "the panels must be contiguous");
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) == groups && panels.size(2) == nb && panels.size(3) == 16 &&
                  p_count * 16 >= n && scales.size(0) == n && scales.size(1) == groups,
              "panels [P, G, bytes, 16] must hold the blocks [N, G, bytes]");
  const bool q8 = format == "q8";
  const bool k_format = is_k_format(format);
  if (!q8) TORCH_CHECK(nb == 16 + 4 * extra_bits(format), format, " blocks have another size than ", nb);
  const int64_t width = scales.element_size();
  const int64_t supers = groups / 8;
  int64_t halves = 0, per_super = 0;
  const uint8_t* src_supers = nullptr;
  int64_t super_stride0 = 0, super_stride1 = 0;
  if (k_format) {
    TORCH_CHECK(super_scales.has_value() && groups % 8 == 0 && width == 1, format,
                " needs its super-block scales and whole super-blocks");
    const at::Tensor& s = *super_scales;
    check_rows(s, "super_scales");
    TORCH_CHECK(s.element_size() == 2 && s.size(0) == n && s.size(1) == supers, "super_scales [N, G / 8, h] of int16");
    halves = s.size(2);
    per_super = halves * 32 + 256;
    TORCH_CHECK(panel_scales.element_size() == 1 && panel_scales.numel() == p_count * supers * per_super,
                "panel scales [P, G / 8, ", per_super, "] of bytes");
    src_supers = static_cast<const uint8_t*>(s.data_ptr());
    super_stride0 = s.stride(0) * 2;
    super_stride1 = s.stride(1) * 2;
  } else {
    TORCH_CHECK(panel_scales.element_size() == width && panel_scales.numel() == p_count * groups * k * 16,
                "panel scales [P, G, ", k, ", 16] of the scales' width");
  }
  const uint8_t* src = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t stride0 = packed.stride(0), stride1 = packed.stride(1);
  const uint8_t* src_scales = static_cast<const uint8_t*>(scales.data_ptr());
  const int64_t scale_stride0 = scales.stride(0) * width, scale_stride1 = scales.stride(1) * width;
  uint8_t* dst = static_cast<uint8_t*>(panels.data_ptr());
  uint8_t* dst_scales = static_cast<uint8_t*>(panel_scales.data_ptr());
  const PanelSource in{src, src_scales, src_supers, stride0, stride1, scale_stride0, scale_stride1, super_stride0,
                       super_stride1, n, 0, groups, nb, k, width, supers, halves, per_super, q8, k_format};
  at::parallel_for(0, p_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) write_panel(in, p, dst, dst_scales);
  });
}

void gguf_k_panels_(const at::Tensor& raw, const std::string& qtype, const c10::optional<at::Tensor>& rows,
                    at::Tensor panels, at::Tensor panel_scales) {
  const int e = k_quant_extra_bits(raw, qtype);
  const int64_t n = raw.size(0), supers = raw.size(1), bytes = raw.size(2);
  const int64_t groups = supers * 8, nb = 16 + 4 * e, halves = e == 2 ? 1 : 2, per_super = halves * 32 + 256;
  at::Tensor order;
  if (rows.has_value()) {
    order = rows->contiguous();
    TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1, "rows: int64 [R]");
  }
  const int64_t count = rows.has_value() ? order.size(0) : n;
  const int64_t* from = rows.has_value() ? order.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; from != nullptr && r < count; ++r)
    TORCH_CHECK(from[r] >= 0 && from[r] < n, "rows: ", from[r], " is not a row of the ", n);
  const int64_t p_count = panels.size(0);
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(1) == groups && panels.size(2) == nb && panels.size(3) == 16 && p_count * 16 >= count,
              "panels [P, G, ", nb, ", 16] (uint8, contiguous) must hold the ", count, " rows");
  TORCH_CHECK(panel_scales.element_size() == 1 && panel_scales.is_contiguous() &&
                  panel_scales.numel() == p_count * supers * per_super,
              "panel scales [P, G / 8, ", per_super, "] of bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(panels.data_ptr());
  uint8_t* dst_scales = static_cast<uint8_t*>(panel_scales.data_ptr());
  at::parallel_for(0, p_count, 1, [&](int64_t begin, int64_t end) {
    // A panel's 16 rows as blocks of 32 (a few KB a row: they stay in cache between the two steps).
    std::vector<uint8_t> packed(16 * groups * nb), scales(16 * groups * 2);
    std::vector<uint16_t> supers_of(16 * supers * halves);
    for (int64_t p = begin; p < end; p++) {
      for (int64_t c = 0; c < 16 && p * 16 + c < count; c++) {
        const int64_t r = p * 16 + c, source = from != nullptr ? from[r] : r;
        k_row_blocks(src + source * supers * bytes, supers, bytes, e, packed.data() + c * groups * nb,
                     scales.data() + c * groups * 2, supers_of.data() + c * supers * halves);
      }
      const PanelSource in{packed.data(), scales.data(), reinterpret_cast<const uint8_t*>(supers_of.data()),
                           groups * nb, nb, groups * 2, 2, supers * halves * 2, halves * 2, count, p * 16, groups, nb,
                           2, 1, supers, halves, per_super, false, true};
      write_panel(in, p, dst, dst_scales);
    }
  });
}
