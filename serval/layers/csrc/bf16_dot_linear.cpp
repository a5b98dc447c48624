// y = x W^T for bfloat16 activations on panel_linear.cpp's q4, q4k, q6k and q8 blocks (the same panel bytes and
// scales), with AVX-512 BF16 dot products: vdpbf16ps does two multiply-adds per 32-bit lane and instruction where a
// float32 FMA does one, and its q4 codes take 2 vector instructions a pair of input positions to form
// (four_pair_codes) where panel_linear.cpp's float32 weights take 7 (measured on an AMD EPYC Zen 4:
// benchmarks/README.md, "bfloat16 dot products" and "Loading at real sizes").
//
// Nothing is rounded before the sums: the file's integer codes are bfloat16 values exactly (q8: |q| <= 128; q4, q6k as
// 128 + q, whose 7 mantissa bits are q), a bfloat16 activation times such a code is exact in float32, and the scales
// are applied per block (q6k: per half block, its sub-blocks of 16). Per row, block b of 32 inputs and output n
// (every step float32, from y = 0):
//   s = steps s = vdpbf16ps(s, (c_a, c_b), (x_a, x_b)) over a run of the block's pairs of positions (a, b) in order,
//       from s = 0: q8's (2p, 2p + 1) for p = 0 .. 15 (one run of 16), the nibble formats' (8i + k, 8i + k + 4) for
//       i, then k = 0 .. 3, in two runs of 8 pairs (half h: i = 2h, 2h + 1)
//   q8 (w = d q, c = q):                    y = fma(d, s, y)
//   q4, q4k (w = d q + m, c = 128 + q):     y = fma(d, s_0, y); y = fma(d, s_1, y); y = fma(m - 128 d, xsum_b, y)
//   q6k (w = d (q - 32), c = 128 + q):      per half h: y = fma(d_h, s_h, y); y = fma(-160 d_h, xsum_bh, y)
// (q4k: d and m are the super-block's float16 d and -dmin times the block's 6-bit sc and mn, exact in float32; q6k:
// d_h is the super-block's d times the half's int8 sc, and -160 d_h, both exact.)
// over the blocks in order, with xsum_b (xsum_bh) the row's sum over the block (half block), one fixed reduction. So
// a row's bits depend on its own values only, whatever the number of rows, the tile or the thread: the
// decoded-in-registers path (few rows) and the decoded-once path (many) run the same steps. They differ from
// panel_linear.cpp's float32 chain by float32 rounding alone (tests/layers/test_bf16_dot_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
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
#include "vec_math.h"

namespace {

using namespace serval_blocks;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#define SERVAL_BF16_DOT_KERNEL
constexpr int64_t kLanes = 16, kCols = 2 * kLanes;  // a tile: two panels of 16 columns side by side
constexpr int kTileRows = 6;  // 12 sums + 12 block sums + 2 code vectors + a broadcast of 32 registers
constexpr int kPairs = kBlock / 2;
// FromPanels::prefetch's distance in blocks: the vector path's (measured on an AMD EPYC Zen 4, where it is the
// default; see FromPanels) and the AMX tiles path's. On an Intel Xeon (Emerald Rapids, 2 threads, one row of the 1B's
// linears from memory) the tiles read at 20.6-21.1 GB/s asking for none, 22.3-22.6 at 4 blocks ahead, 24.4-25.0 at 8
// and 23.5-24.9 at 12 or 16; the vectors 21.6-22.0 at 4 and 21.9-22.4 at 8, within the noise, so they keep 4
// (benchmarks/README.md, "The tiles ask for their next blocks").
constexpr int64_t kPrefetchBlocks = 4, kTilePrefetchBlocks = 8;
// Up to how many rows a tile's codes are decoded in registers, once per pass of kTileRows rows, rather than once into
// a buffer that the passes read: the buffer (a few hundred KB a tile at K = 4,096) is written to and read back from
// L2, which measured slower up to 32 rows (Q4_K at 8 rows 1.4x, 16 rows 1.2x) and for q6k up to 16 (its codes cost
// more to decode; at 32 rows the buffer measured 1.1x faster) on an AMD EPYC Zen 4 (benchmarks/README.md).
constexpr int64_t decoded_in_registers_up_to(int f) { return f == kQ6K ? 16 : 32; }
// Runs of pairs that share a scale: q6k's two sub-blocks of 16 positions, the others' whole block.
constexpr int halves(int f) { return f == kQ6K ? 2 : 1; }

inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Pair p of a block's q8 codes for one panel's 16 columns: lane j holds column j's (c_2p, c_2p+1) as bfloat16 (rows
// 2p and 2p + 1; an integer of at most 8 bits is a float32 whose high half is its bfloat16).
inline __m512i q8_pair_codes(const uint8_t* q, int pair) {
  const __m512i even = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes(q + 2 * pair * 16))));
  const __m512i odd = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes(q + (2 * pair + 1) * 16))));
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)),
                                   0xF8);  // A | (B & C)
}

#if defined(__AVX512VBMI__)
struct Bytes64 {
  alignas(64) uint8_t b[64];
  __m512i load() const { return _mm512_load_si512(b); }
};

// vpermb's index vectors, made at compile time (a static made at run time put a guard in the loop). Lane j of the
// result: of 4 rows of 16 bytes, column j's byte of each row in order; of 2 rows, column j's byte of the first at
// byte 0 and of the second at byte 2, bytes 1 and 3 from byte 63 (zero).
constexpr Bytes64 column_bytes() {
  Bytes64 index{};
  for (int j = 0; j < 16; ++j)
    for (int k = 0; k < 4; ++k) index.b[4 * j + k] = static_cast<uint8_t>(16 * k + j);
  return index;
}
constexpr Bytes64 column_bytes_of_two_rows() {
  Bytes64 index{};
  for (int j = 0; j < 16; ++j) {
    index.b[4 * j] = static_cast<uint8_t>(j);
    index.b[4 * j + 2] = static_cast<uint8_t>(16 + j);
    index.b[4 * j + 1] = index.b[4 * j + 3] = 63;
  }
  return index;
}
constexpr Bytes64 kColumnBytes = column_bytes(), kColumnBytesOfTwoRows = column_bytes_of_two_rows();
#endif

// Pairs p .. p + 3 (p a multiple of 4) of a block's codes for one panel's 16 columns, as 4 vectors: vector k's lane
// j holds column j's codes of positions 2p + k and 2p + k + 4 as bfloat16 (q8: positions 2(p + k) and 2(p + k) + 1).
// The nibble formats' x rows are permuted to match (permuted_rows). Their 4 byte rows (2 positions each: byte j of
// row p holds column j's code 2p in the low nibble and 2p + 1 in the high) are transposed by one byte permutation
// (AVX-512 VBMI), so that lane j holds position 2p + m at bits 4m; vector k is then that shifted right by 4k, masked
// to bits 0-3 and 16-19 and joined to 0x4300 (bfloat16 128) in each half: 128 + q, exact. q6k's bits 4-5 (row
// 16 + p / 2 for positions 2p .. 2p + 3 at bits 2m, the next row for the next 4) are put at bits 2m and 16 + 2m by a
// second permutation and shifted to bits 4-5 and 20-21. 2 vector instructions a vector for q4 and q4k, 4 for q6k,
// where one pair at a time took 2.5 and 4 with 1.5 byte permutations (measured on an AMD EPYC Zen 4: one row, in
// cache, 1 thread, Q4_K 18.8 → 21.4 GB/s; benchmarks/README.md).
template <int F>
inline void four_pair_codes(const uint8_t* q, int pair, __m512i out[4]) {
  if constexpr (F == kQ8) {
    for (int k = 0; k < 4; ++k) out[k] = q8_pair_codes(q, pair + k);
  } else {
    const __m512i low_bits = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
    const __m512i top_bits = _mm512_set1_epi32(0x00300030);
#if defined(__AVX512VBMI__)
    const __m512i columns = _mm512_permutexvar_epi8(kColumnBytes.load(), _mm512_loadu_si512(q + pair * 16));
    __m512i high = _mm512_setzero_si512();
    if constexpr (F == kQ6K)
      high = _mm512_permutexvar_epi8(kColumnBytesOfTwoRows.load(), _mm512_zextsi256_si512(_mm256_loadu_si256(
                                                                      reinterpret_cast<const __m256i*>(q + (16 + pair / 2) * 16))));
#else  // the same lanes from bytes widened one row at a time
    const __m512i columns = _mm512_or_si512(
        _mm512_or_si512(_mm512_cvtepu8_epi32(load_bytes(q + pair * 16)),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(load_bytes(q + (pair + 1) * 16)), 8)),
        _mm512_or_si512(_mm512_slli_epi32(_mm512_cvtepu8_epi32(load_bytes(q + (pair + 2) * 16)), 16),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(load_bytes(q + (pair + 3) * 16)), 24)));
    __m512i high = _mm512_setzero_si512();
    if constexpr (F == kQ6K)
      high = _mm512_or_si512(_mm512_cvtepu8_epi32(load_bytes(q + (16 + pair / 2) * 16)),
                             _mm512_slli_epi32(_mm512_cvtepu8_epi32(load_bytes(q + (17 + pair / 2) * 16)), 16));
#endif
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      out[k] = _mm512_ternarylogic_epi32(k ? _mm512_srli_epi32(columns, 4 * k) : columns, low_bits, bias,
                                         0xEA);  // (A & B) | C
      if constexpr (F == kQ6K) {
        const __m512i top = k < 2 ? _mm512_slli_epi32(high, 4 - 2 * k) : k == 2 ? high : _mm512_srli_epi32(high, 2);
        out[k] = _mm512_ternarylogic_epi32(out[k], top, top_bits, 0xF8);  // A | (B & C)
      }
    }
  }
}

inline __m512 float16s(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 unsigned_bytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load_bytes(p))); }

// The panels of a weight: panel P's block g starts at packed + (P G + g) block_bytes; its scales at
// scales + (P G + g) scale_bytes (q4: float16 d and m, q8: d), or for q4k in its super-block's scales (see
// panel_linear.cpp: per super-block float16 d and -dmin rows, then per block the sc and mn byte rows).
struct Panels {
  const uint8_t* packed;
  const uint8_t* scales;
  int64_t groups, block_bytes, scale_bytes, super_block_bytes;
  const uint8_t* codes(int64_t tile, int c, int64_t g) const { return packed + ((2 * tile + c) * groups + g) * block_bytes; }
  const uint8_t* scale(int64_t tile, int c, int64_t g) const { return scales + ((2 * tile + c) * groups + g) * scale_bytes; }
  const uint8_t* super_block(int64_t tile, int c, int64_t g) const {
    return scales + (((2 * tile + c) * groups + g) / kSuperBlocks) * super_block_bytes;
  }
};

// A block's (q6k: half block's) scales for one panel: d, and for q4 and q4k m - 128 d (one rounding), for q6k -160 d
// (exact), the coefficient of the row's sum over it.
template <int F>
inline void panel_scales(const Panels& w, int64_t tile, int c, int64_t g, int half, __m512& d, __m512& offset) {
  if constexpr (F == kQ6K) {
    const uint8_t* super = w.super_block(tile, c, g);
    const uint8_t* block = super + super_rows(kQ6K) * 32 + (g % kSuperBlocks) * scale_rows(kQ6K) * 16;
    d = _mm512_mul_ps(float16s(super), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes(block + half * 16))));
    offset = _mm512_mul_ps(d, _mm512_set1_ps(-160.f));
  } else if constexpr (F == kQ4K) {
    const uint8_t* super = w.super_block(tile, c, g);
    const uint8_t* block = super + super_rows(kQ4K) * 32 + (g % kSuperBlocks) * scale_rows(kQ4K) * 16;
    d = _mm512_mul_ps(float16s(super), unsigned_bytes(block));
    offset = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.f), _mm512_mul_ps(float16s(super + 32), unsigned_bytes(block + 16)));
  } else {
    const uint8_t* s = w.scale(tile, c, g);
    d = float16s(s);
    offset = F == kQ4 ? _mm512_fmadd_ps(d, _mm512_set1_ps(-128.f), float16s(s + 32)) : _mm512_setzero_ps();
  }
}

// Where a tile's codes and scales come from: decoded from the panels as they are used (few rows), or from a tile
// decoded once into a buffer (many rows): the same values either way.
template <int F>
struct FromPanels {
  const Panels& w;
  int64_t tile, ahead;
  bool prefetching;
  int64_t distance = kPrefetchBlocks;  // in blocks
  void scales(int64_t g, int half, __m512 d[2], __m512 offset[2]) const {
    for (int c = 0; c < 2; ++c) panel_scales<F>(w, tile, c, g, half, d[c], offset[c]);
  }
  // Asks for the block ``distance`` past g while block g computes: of this tile, or past its end of the tile
  // ``ahead`` (none where ahead is this tile, its thread's last). The hardware prefetcher alone, or asking for the
  // same block of the next tile (panel_linear.cpp's prefetch_block), read one row's 8B-sized weights out of cache at
  // 35-36 GB/s on 2 threads of an AMD EPYC Zen 4, where a plain read ran 55-60; 4 blocks ahead, 41-44
  // (benchmarks/README.md, "Prefetch distance"). Always inlined (a function of prefetches alone is deleted by GCC).
  __attribute__((always_inline)) void prefetch(int64_t g) const {
    if (!prefetching) return;
    int64_t at = tile, block = g + distance;
    if (block >= w.groups) {
      if (ahead == tile) return;
      at = ahead;
      block -= w.groups;
      if (block >= w.groups) return;  // fewer blocks a panel than the distance
    }
    for (int c = 0; c < 2; ++c) {
      for (int64_t b = 0; b < w.block_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.codes(at, c, block) + b), _MM_HINT_T0);
      if constexpr (k_scales(F)) {
        const uint8_t* super = w.super_block(at, c, block);
        _mm_prefetch(reinterpret_cast<const char*>(super + super_rows(F) * 32 + (block % kSuperBlocks) * scale_rows(F) * 16),
                     _MM_HINT_T0);
        if (block % kSuperBlocks == 0) _mm_prefetch(reinterpret_cast<const char*>(super), _MM_HINT_T0);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w.scale(at, c, block)), _MM_HINT_T0);
      }
    }
  }
  void four_pairs(int64_t g, int pair, int c, __m512i out[4]) const { four_pair_codes<F>(w.codes(tile, c, g), pair, out); }
};

// A tile decoded: per block, its 16 pairs' code vectors [16][2] and per half its scales [2 (d, offset)][2][16].
constexpr int64_t buffered_block(int f) { return kPairs * kCols + halves(f) * 2 * kCols; }  // 32-bit words
template <int F>
struct FromBuffer {
  const uint32_t* tile;
  void scales(int64_t g, int half, __m512 d[2], __m512 offset[2]) const {
    const float* s = reinterpret_cast<const float*>(tile + g * buffered_block(F) + kPairs * kCols + half * 2 * kCols);
    for (int c = 0; c < 2; ++c) {
      d[c] = _mm512_loadu_ps(s + c * kLanes);
      offset[c] = _mm512_loadu_ps(s + kCols + c * kLanes);
    }
  }
  void prefetch(int64_t) const {}
  void four_pairs(int64_t g, int pair, int c, __m512i out[4]) const {
    for (int i = 0; i < 4; ++i) out[i] = _mm512_loadu_si512(tile + g * buffered_block(F) + ((pair + i) * 2 + c) * kLanes);
  }
};

template <int F>
void decode_tile(const Panels& w, int64_t tile, uint32_t* out) {
  for (int64_t g = 0; g < w.groups; ++g) {
    uint32_t* block = out + g * buffered_block(F);
    for (int pair = 0; pair < kPairs; pair += 4)
      for (int c = 0; c < 2; ++c) {
        __m512i codes[4];
        four_pair_codes<F>(w.codes(tile, c, g), pair, codes);
        for (int i = 0; i < 4; ++i) _mm512_storeu_si512(block + ((pair + i) * 2 + c) * kLanes, codes[i]);
      }
    for (int half = 0; half < halves(F); ++half) {
      float* s = reinterpret_cast<float*>(block + kPairs * kCols + half * 2 * kCols);
      for (int c = 0; c < 2; ++c) {
        __m512 d, offset;
        panel_scales<F>(w, tile, c, g, half, d, offset);
        _mm512_storeu_ps(s + c * kLanes, d);
        _mm512_storeu_ps(s + kCols + c * kLanes, offset);
      }
    }
  }
}

inline void store_out(float* y, __m512 v, int64_t count) { _mm512_mask_storeu_ps(y, serval::first_mask16(count), v); }
inline void store_out(uint16_t* y, __m512 v, int64_t count) { serval::store_bfloat16(y, v, count); }

// The sums over a block's pairs run as chains of vdpbf16ps, one a row and panel: at one row, 2 chains that long left
// the kernel waiting on vdpbf16ps's latency. So the nibble formats sum each block's 16 pairs as two runs of 8, q6k's
// halves with their own scales, q4's and q4k's with the block's (two FMAs into y), and one row computes both runs'
// chains together: measured 1.09x faster for Q4_K and 1.10x for Q6_K at one row in cache on an AMD EPYC Zen 4
// (benchmarks/README.md, "Two chains a block"). More rows have chains enough; they compute the runs one after the
// other, their registers going to the rows: the same steps on the same values, so the same bits. q8 (which measured no
// faster so) sums its block as one run.
constexpr int runs(int f) { return f == kQ8 ? 1 : 2; }
constexpr int kRunsSideBySide = 1;  // rows up to which a block's runs are computed together

// R rows (x bfloat16 with ldx per row, xsum [R][G halves(F)] their block (half block) sums) times one tile's columns
// n0 ...
template <int F, int R, typename Source, typename Out>
void tile_rows(const Source& source, int64_t groups, const uint16_t* x, int64_t ldx, const float* xsum, Out* y,
               int64_t N, int64_t n0) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  constexpr int H = halves(F), kRuns = runs(F), kRun = kPairs / kRuns, kTogether = R <= kRunsSideBySide ? kRuns : 1;
  for (int64_t g = 0; g < groups; ++g) {
    source.prefetch(g);
    const uint16_t* xg = x + g * kBlock;
    for (int run0 = 0; run0 < kRuns; run0 += kTogether) {
      __m512 sums[kTogether][R][2];
      for (int j = 0; j < kTogether; ++j)
        for (int r = 0; r < R; ++r) sums[j][r][0] = sums[j][r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int step = 0; step < kRun; step += 4) {
        __m512i codes[kTogether][2][4];  // [run][column vector][code vector k of pairs p .. p + 3]
        for (int j = 0; j < kTogether; ++j)
          for (int c = 0; c < 2; ++c) source.four_pairs(g, (run0 + j) * kRun + step, c, codes[j][c]);
        for (int i = 0; i < 4; ++i)  // vector 0, 1, 2, 3: each sum's steps in that order
          for (int r = 0; r < R; ++r)
            for (int j = 0; j < kTogether; ++j) {
              int32_t word;
              std::memcpy(&word, xg + r * ldx + 2 * ((run0 + j) * kRun + step + i), sizeof(word));
              const __m512bh xb = (__m512bh)_mm512_set1_epi32(word);
              for (int c = 0; c < 2; ++c)
                sums[j][r][c] = _mm512_dpbf16_ps(sums[j][r][c], (__m512bh)codes[j][c][i], xb);
            }
        if constexpr (kTogether > 1)  // GCC sank one run's chain to the loop's end, where nothing hid its latency
          for (int j = 0; j < kTogether; ++j)
            for (int r = 0; r < R; ++r) asm volatile("" : "+v"(sums[j][r][0]), "+v"(sums[j][r][1]));
      }
      // The scales only now: held through the pairs' loop, they left too few registers for the sums (spills).
      __m512 d[2], offset[2];
      for (int j = 0; j < kTogether; ++j) {
        const int run = run0 + j, half = H == 2 ? run : 0;
        if (H == 2 || j == 0) source.scales(g, half, d, offset);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < 2; ++c) {
            acc[r][c] = _mm512_fmadd_ps(d[c], sums[j][r][c], acc[r][c]);
            if constexpr (F != kQ8)
              if (H == 2 || run == kRuns - 1)  // the block's offset once, after its last run
                acc[r][c] = _mm512_fmadd_ps(offset[c], _mm512_set1_ps(xsum[(r * groups + g) * H + half]), acc[r][c]);
          }
      }
    }
  }
  const int64_t cols = std::min<int64_t>(kCols, N - n0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c)
      if (cols > c * kLanes) store_out(y + r * N + n0 + c * kLanes, acc[r][c], cols - c * kLanes);
}

template <int F, int R, typename Source, typename Out>
void some_rows(int64_t rows, const Source& source, int64_t groups, const uint16_t* x, int64_t ldx, const float* xsum,
               Out* y, int64_t N, int64_t n0) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<F, R>(source, groups, x, ldx, xsum, y, N, n0);
    some_rows<F, R - 1>(rows, source, groups, x, ldx, xsum, y, N, n0);
  }
}

// Rows' sums acc [rows][kCols] into tile t's columns of y (rows N apart), the columns past N left out.
template <typename Out>
void store_tile(const float* acc, int64_t rows, Out* y, int64_t N, int64_t t) {
  const int64_t cols = std::min<int64_t>(kCols, N - t * kCols);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 2; ++c)
      if (cols > c * kLanes)
        store_out(y + r * N + t * kCols + c * kLanes, _mm512_loadu_ps(acc + r * kCols + c * kLanes), cols - c * kLanes);
}

// The same steps by float32 FMAs, for many rows where the FMA units are the limit (an Intel Xeon runs vdpbf16ps on
// one port and FMAs on two: 16 rows of Q4_K measured 1.1-1.35x slower by dot products than panel_linear.cpp's
// float32 kernel there, one row 1.5x faster; benchmarks/README.md, "Dot products as FMAs"). On a CPU whose vdpbf16ps
// is two FMAs in turn, the second position of the pair first (t = fma(c_a, x_a, fma(c_b, x_b, t))), with no
// rounding of the exact products, these are its bits: bf16_dot_is_two_fmas() checks that at run time, and
// linear.py takes this path only where it holds and measured faster. Denormals, which vdpbf16ps flushes, never
// arise: x is flushed below 2^-100 (flush_tiny_rows) and every partial sum is then a multiple of 2^-107.
// A block's codes [pair][panel][a, b][16] and its scales [half][d, offset][panel][16], as float32.
constexpr int64_t kStepCodes = kPairs * 2 * 2 * kLanes, kStepScales = 2 * 2 * kCols;

template <int F>
void decode_block_floats(const Panels& w, int64_t tile, int64_t g, float* codes, float* scales) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int pair = 0; pair < kPairs; pair += 4)
    for (int c = 0; c < 2; ++c) {
      __m512i words[4];
      four_pair_codes<F>(w.codes(tile, c, g), pair, words);
      for (int i = 0; i < 4; ++i) {
        float* out = codes + ((pair + i) * 2 + c) * 2 * kLanes;
        _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(words[i], 16)));
        _mm512_storeu_ps(out + kLanes, _mm512_castsi512_ps(_mm512_and_si512(words[i], high)));
      }
    }
  for (int half = 0; half < halves(F); ++half)
    for (int c = 0; c < 2; ++c) {
      __m512 d, offset;
      panel_scales<F>(w, tile, c, g, half, d, offset);
      _mm512_storeu_ps(scales + half * 2 * kCols + c * kLanes, d);
      _mm512_storeu_ps(scales + half * 2 * kCols + kCols + c * kLanes, offset);
    }
}

// tile_rows' steps for R rows on one block g, x as float32 (xf: the rows' block g, ldx apart), into acc [R][32].
// The rows' running sums stay in acc (L1), each updated once a run: registers hold the R x 2 run sums, so a pass
// takes up to kFmaRows rows (twice the chains of latency to hide as two FMAs in turn need).
template <int F, int R>
void block_rows_by_fmas(const float* codes, const float* scales, const float* xf, int64_t ldx, const float* xsum,
                        int64_t groups, int64_t g, float* acc) {
  constexpr int H = halves(F), kRuns = runs(F), kRun = kPairs / kRuns;
  for (int run = 0; run < kRuns; ++run) {
    __m512 sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
    for (int p = run * kRun; p < (run + 1) * kRun; ++p) {
      const float* pair = codes + p * 2 * 2 * kLanes;
      const __m512 ca[2] = {_mm512_loadu_ps(pair), _mm512_loadu_ps(pair + 2 * kLanes)};
      const __m512 cb[2] = {_mm512_loadu_ps(pair + kLanes), _mm512_loadu_ps(pair + 3 * kLanes)};
      for (int r = 0; r < R; ++r) {
        const __m512 xa = _mm512_set1_ps(xf[r * ldx + 2 * p]), xb = _mm512_set1_ps(xf[r * ldx + 2 * p + 1]);
        for (int c = 0; c < 2; ++c) sums[r][c] = _mm512_fmadd_ps(ca[c], xa, _mm512_fmadd_ps(cb[c], xb, sums[r][c]));
      }
    }
    const int half = H == 2 ? run : 0;
    const float* s = scales + half * 2 * kCols;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) {
        float* out = acc + r * kCols + c * kLanes;
        __m512 a = _mm512_fmadd_ps(_mm512_loadu_ps(s + c * kLanes), sums[r][c], _mm512_loadu_ps(out));
        if constexpr (F != kQ8)
          if (H == 2 || run == kRuns - 1)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(s + kCols + c * kLanes),
                                _mm512_set1_ps(xsum[(r * groups + g) * H + half]), a);
        _mm512_storeu_ps(out, a);
      }
  }
}

template <int F, int R>
void some_rows_by_fmas(int64_t rows, const float* codes, const float* scales, const float* xf, int64_t ldx,
                       const float* xsum, int64_t groups, int64_t g, float* acc) {
  if constexpr (R > 0) {
    if (rows == R) return block_rows_by_fmas<F, R>(codes, scales, xf, ldx, xsum, groups, g, acc);
    some_rows_by_fmas<F, R - 1>(rows, codes, scales, xf, ldx, xsum, groups, g, acc);
  }
}

// 16 run sums + 4 code vectors + 2 broadcasts of 32 registers. The rows are split into passes of equal size (8 rows:
// one pass, not 6 + 2, whose 2-row pass has too few chains to hide the FMAs' latency).
constexpr int kFmaRows = 8;
// The rows a tile's blocks are walked for at once: their float32 activations (rows x K x 4 bytes) within this, so
// that they stay in L2 from one tile to the next. At 128 rows of K = 8192 (a prefill chunk through a down
// projection) the whole 4 MB went to L3 and back for every tile: 1.4x the float32 kernel's time, 1.1-1.2x so
// (Intel Xeon, benchmarks/README.md, "The dot products by default on the Xeon").
constexpr int64_t kFmaRowBytes = 1 << 20;

// Each block's codes decoded once per block of rows into L1; the rows' sums kept in acc [rows][32] between blocks.
template <int F, typename Out>
void gemm_by_fmas(const float* xf, int64_t M, int64_t ldx, const float* xsum, const Panels& w, int64_t N, Out* y) {
  const int64_t tiles = (N + kCols - 1) / kCols, G = w.groups, sums_per_row = G * halves(F);
  const int64_t block = std::max<int64_t>(2 * kFmaRows, kFmaRowBytes / (ldx * 4));
  serval::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float* codes = serval::scratch(0, kStepCodes + kStepScales + std::min(M, block) * kCols);
    float* scales = codes + kStepCodes;
    float* acc = scales + kStepScales;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0), passes = (rows + kFmaRows - 1) / kFmaRows,
                    per_pass = (rows + passes - 1) / passes;
      const float* x = xf + m0 * ldx;
      const float* sums = xsum + m0 * sums_per_row;
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc, acc + rows * kCols, 0.f);
        for (int64_t g = 0; g < G; ++g) {
          decode_block_floats<F>(w, t, g, codes, scales);
          for (int64_t r0 = 0; r0 < rows; r0 += per_pass)
            some_rows_by_fmas<F, kFmaRows>(std::min(per_pass, rows - r0), codes, scales, x + r0 * ldx + g * kBlock,
                                           ldx, sums + r0 * sums_per_row, G, g, acc + r0 * kCols);
        }
        store_tile(acc, rows, y + m0 * N, N, t);
      }
    }
  });
}

template <int F, typename Out>
void gemm(const uint16_t* x, int64_t M, int64_t ldx, const float* xsum, const Panels& w, int64_t N, Out* y) {
  const int64_t tiles = (N + kCols - 1) / kCols, G = w.groups;
  serval::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if (M <= decoded_in_registers_up_to(F)) {
      const int64_t sums_per_row = G * halves(F);
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < M; r0 += kTileRows)  // the first pass prefetches; the later ones find the tile cached
          some_rows<F, kTileRows>(std::min<int64_t>(kTileRows, M - r0),
                                  FromPanels<F>{w, t, std::min(t + 1, end - 1), r0 == 0}, G, x + r0 * ldx, ldx,
                                  xsum + r0 * sums_per_row, y + r0 * N, N, t * kCols);
      return;
    }
    // Many rows: each tile's codes decoded once for all of them.
    uint32_t* buffer = reinterpret_cast<uint32_t*>(serval::scratch(0, G * buffered_block(F)));
    const int64_t sums_per_row = G * halves(F);
    for (int64_t t = begin; t < end; ++t) {
      decode_tile<F>(w, t, buffer);
      const FromBuffer<F> source{buffer};
      int64_t r0 = 0;
      for (; r0 + kTileRows <= M; r0 += kTileRows)
        tile_rows<F, kTileRows>(source, G, x + r0 * ldx, ldx, xsum + r0 * sums_per_row, y + r0 * N, N, t * kCols);
      some_rows<F, kTileRows - 1>(M - r0, source, G, x + r0 * ldx, ldx, xsum + r0 * sums_per_row, y + r0 * N, N,
                                  t * kCols);
    }
  });
}

inline __m512 widened(const uint16_t* p) {  // 16 bfloat16 values as float32: exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Each row's sums over its half blocks (q6k), [M][2 G]: the 16 values widened to float32, then
// _mm512_reduce_add_ps (one fixed tree).
void half_block_sums(const uint16_t* x, int64_t M, int64_t ldx, int64_t G, float* out) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t h = 0; h < 2 * G; ++h) out[r * 2 * G + h] = _mm512_reduce_add_ps(widened(x + r * ldx + h * kBlock / 2));
}

// x's rows [M][K] with each 8 positions' two halves interleaved, into out [M][padded]: positions 8s + k and
// 8s + k + 4 side by side, as four_pair_codes pairs the nibble formats' codes.
void permuted_rows(const uint16_t* x, int64_t M, int64_t ldx, int64_t padded, uint16_t* out) {
  const __m512i order = _mm512_set_epi16(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21, 17, 20, 16,
                                         15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < padded; k += 32)
      _mm512_storeu_si512(out + r * padded + k, _mm512_permutexvar_epi16(order, _mm512_loadu_si512(x + r * ldx + k)));
}

// x's rows [M][K] into out [M][padded], zeros after K, each value of magnitude below 2^-100 (exponent field < 27)
// made 0: the FMA path's condition for vdpbf16ps's bits (see gemm_by_fmas); nothing a model computes is that small.
void flush_tiny_rows(const uint16_t* x, int64_t M, int64_t K, int64_t padded, uint16_t* out) {
  const __m512i exponent = _mm512_set1_epi16(0x7F80), smallest = _mm512_set1_epi16(27 << 7);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < padded; k += 32) {
      const __mmask32 in = k + 32 <= K ? ~__mmask32(0) : k >= K ? 0 : (__mmask32(1) << (K - k)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi16(in, x + r * K + k);
      const __mmask32 kept = _mm512_cmpge_epu16_mask(_mm512_and_si512(v, exponent), smallest);
      _mm512_storeu_si512(out + r * padded + k, _mm512_maskz_mov_epi16(kept, v));
    }
}

// bfloat16 rows [M][padded] as float32 (exact).
void widen_rows(const uint16_t* x, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += 16)
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16)));
}

std::atomic<int64_t> fma_steps_from_rows{INT64_MAX};

// Each row's block sums, [M][G]: the 32 values widened to float32, the two halves added lane by lane, then
// _mm512_reduce_add_ps (one fixed tree).
void block_sums(const uint16_t* x, int64_t M, int64_t ldx, int64_t G, float* out) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + r * ldx + g * kBlock;
      out[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(widened(p), widened(p + 16)));
    }
}
#endif

// AMX tiles (Intel Sapphire Rapids and later; linear.py's use_dot_products "amx"): per block and panel, tdpbf16ps
// sums the block's 16 pairs for up to 16 rows at once (q6k: up to 8, each row's two halves as two A rows), from the
// same code vectors (four_pair_codes, one row of B a pair) and the same permuted bfloat16 rows (A), into a zeroed C;
// the scales then as tile_rows applies them (y = fma(d, s, y), y = fma(offset, xsum, y)), block after block. The tile
// unit's sums round otherwise than vdpbf16ps's chain (no order of FMAs reproduces them), so a call with the tiles on
// takes them for every row count: each (row, column)'s sum depends on that row's and that column's values alone,
// whatever the rows beside it (tests/layers/test_bf16_dot_linear.py). Measured on an Intel Xeon (Emerald Rapids, 2
// threads): at one row 0.9-1.2x the dot products' speed by format and shape, 3-4x from 8 rows (benchmarks/README.md,
// "AMX tiles for the dot products").
#if defined(SERVAL_BF16_DOT_KERNEL) && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SERVAL_BF16_TILES
// Whether tile instructions may run: the CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22) and Linux
// grants this process the tile data state (XFEATURE 18), asked once; without that grant the first tile instruction
// faults.
bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// ldtilecfg's 64 bytes (palette 1): per tile register its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kTileRowsAmx = 16;  // rows of a C tile (and of A)

// C tmm0/1 and A tmm2/3: rows x 16 float32 and rows x 16 bfloat16 pairs (a block); B tmm4/5: a block's 16 pairs
// of 16 columns.
__attribute__((target("amx-tile"))) inline void configure_tiles(int64_t rows) {
  TileConfig cfg;
  for (int s = 0; s < 2; ++s) {
    cfg.rows[s] = cfg.rows[2 + s] = static_cast<uint8_t>(rows);
    cfg.rows[4 + s] = kPairs;
    cfg.bytes_per_row[s] = cfg.bytes_per_row[2 + s] = cfg.bytes_per_row[4 + s] = 64;
  }
  asm volatile("" : : "m"(cfg) : "memory");  // ldtilecfg's intrinsic tells the compiler of 8 bytes read, not 64
  _tile_loadconfig(&cfg);
}

// Set S's C = A B: A the rows' block (a_stride bytes apart), B the block's codes.
template <int S>
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_dot(const uint16_t* a, int64_t a_stride,
                                                                  const uint8_t* b) {
  asm volatile("" ::: "memory");  // the codes' stores before the tile loads them
  if constexpr (S == 0) {  // (the intrinsics name their tile registers by literal numbers)
    _tile_zero(0);
    _tile_loadd(2, a, a_stride);
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, a, a_stride);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(1, 3, 5);
  }
}

template <int S>  // set S's C into out [rows][16]
__attribute__((target("amx-tile"))) inline void tile_sums(float* out) {
  if constexpr (S == 0) _tile_stored(0, out, 64); else _tile_stored(1, out, 64);
  asm volatile("" ::: "memory");
}

// Block g of panel c of tile t as a B tile: row p is pair p's code vector (16 columns' two codes).
template <int F>
inline void block_codes(const Panels& w, int64_t t, int c, int64_t g, uint8_t* b) {
  for (int p = 0; p < kPairs; p += 4) {
    __m512i v[4];
    four_pair_codes<F>(w.codes(t, c, g), p, v);
    for (int i = 0; i < 4; ++i) _mm512_store_si512(reinterpret_cast<__m512i*>(b + 64 * (p + i)), v[i]);
  }
}

// A row tile's walk over one tile's units, (block g, panel c) as u = 2 g + c: a pipeline of three stages a unit
// apart (unit u + 1's codes stored, u's dot product issued, u - 1's sums stored and its steps): the codes' stores
// and the tile load that reads them a unit apart, where back to back they measured 1.1x slower at one row.
template <int F>
struct TileUnits {
  static constexpr int H = halves(F);  // A rows a row: q6k's halves, each with the other's pairs zero
  const Panels& w;
  int64_t t, rows, ldx, groups;
  const uint16_t* a;  // the row tile's A rows (permuted for the nibble formats; q6k's split in halves)
  const float* xsum;  // its block (half block) sums
  float* acc;         // [rows][kCols]
  uint8_t (*codes)[kPairs * 64];
  float (*sums)[kTileRowsAmx * 16];
  int64_t units() const { return 2 * groups; }
  void decode(int64_t u) const { block_codes<F>(w, t, static_cast<int>(u % 2), u / 2, codes[u % 2]); }
  template <int S>
  __attribute__((target("amx-tile,amx-bf16"))) void advance(int64_t u) const {
    if (u + 1 < units()) decode(u + 1);
    tile_dot<S>(a + (u / 2) * kBlock, ldx * 2, codes[S]);
    if (u >= 1) {
      tile_sums<1 - S>(sums[1 - S]);
      steps(u - 1, sums[1 - S]);
    }
  }
  // tile_rows' float32 steps for unit u from its sums s [rows H][16]: q6k's halves in turn.
  void steps(int64_t u, const float* s) const {
    const int c = static_cast<int>(u % 2);
    const int64_t g = u / 2;
    __m512 d[H], offset[H];
    for (int half = 0; half < H; ++half) panel_scales<F>(w, t, c, g, half, d[half], offset[half]);
    for (int64_t r = 0; r < rows; ++r) {
      float* out = acc + r * kCols + c * kLanes;
      __m512 v = _mm512_load_ps(out);
      for (int half = 0; half < H; ++half) {
        v = _mm512_fmadd_ps(d[half], _mm512_load_ps(s + 16 * (r * H + half)), v);
        if constexpr (F != kQ8) v = _mm512_fmadd_ps(offset[half], _mm512_set1_ps(xsum[(r * groups + g) * H + half]), v);
      }
      _mm512_store_ps(out, v);
    }
  }
};

// Tiles begin .. end of y = x W^T, 16 A rows at a time (the tile configuration set per row count, released at the
// end). a: the A rows, ldx apart (q6k: 2 a row).
template <int F, typename Out>
__attribute__((target("amx-tile,amx-bf16"))) void tiles_range(const uint16_t* a, int64_t M, int64_t ldx,
                                                              const float* xsum, const Panels& w, int64_t N, Out* y,
                                                              int64_t begin, int64_t end) {
  constexpr int H = halves(F);
  constexpr int64_t kRowsATile = kTileRowsAmx / H;
  const int64_t G = w.groups, units = 2 * G;
  alignas(64) uint8_t codes[2][kPairs * 64];
  alignas(64) float sums[2][kTileRowsAmx * 16];
  alignas(64) float acc[kTileRowsAmx * kCols];
  int64_t configured = 0;
  for (int64_t t = begin; t < end; ++t)
    for (int64_t r0 = 0; r0 < M; r0 += kRowsATile) {
      const int64_t rows = std::min(kRowsATile, M - r0);
      if (rows != configured) {
        configure_tiles(rows * H);
        configured = rows;
      }
      std::fill(acc, acc + rows * kCols, 0.f);
      const TileUnits<F> pipe{w, t, rows, ldx, G, a + r0 * H * ldx, xsum + r0 * G * H, acc, codes, sums};
      // The blocks kTilePrefetchBlocks on asked for on the first pass (the one that reads from memory), as the vector
      // path does: the hardware prefetcher alone kept a core's reads below its share of the memory's rate. The
      // same bits.
      const FromPanels<F> ahead{w, t, t + 1 < end ? t + 1 : t, r0 == 0, kTilePrefetchBlocks};
      pipe.decode(0);
      for (int64_t u = 0; u < units; u += 2) {  // 2 panels a block: units is even
        ahead.prefetch(u / 2);
        pipe.template advance<0>(u);
        pipe.template advance<1>(u + 1);
      }
      tile_sums<1>(sums[1]);
      pipe.steps(units - 1, sums[1]);
      store_tile(acc, rows, y + r0 * N, N, t);
    }
  if (configured) _tile_release();
}

// q6k's A rows: per row two, the first with each block's second half zero, the second with its first half zero, so
// that one tile dot product sums both halves apart.
void split_halves(const uint16_t* x, int64_t M, int64_t ldx, uint16_t* out) {
  for (int64_t r = 0; r < M; ++r)
    for (int half = 0; half < 2; ++half) {
      uint16_t* row = out + (2 * r + half) * ldx;
      for (int64_t b = 0; b < ldx; b += kBlock) {
        std::memset(row + b, 0, kBlock * sizeof(uint16_t));
        std::memcpy(row + b + half * kBlock / 2, x + r * ldx + b + half * kBlock / 2, kBlock / 2 * sizeof(uint16_t));
      }
    }
}

template <int F, typename Out>
void gemm_by_tiles(const uint16_t* x, int64_t M, int64_t ldx, const float* xsum, const Panels& w, int64_t N, Out* y) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  serval::parallel_for(0, tiles, 1,
                       [&](int64_t begin, int64_t end) { tiles_range<F>(x, M, ldx, xsum, w, N, y, begin, end); });
}

#endif

}  // namespace

bool block_bf16_dot_kernel_available() {
#if defined(SERVAL_BF16_DOT_KERNEL)
  return true;
#else
  return false;
#endif
}

// Whether this CPU's vdpbf16ps gives, lane by lane, t = fma(c_a, x_a, fma(c_b, x_b, t)) for integer codes c of at
// most 8 bits and x of magnitude 2^-100 to 2^100 or 0 (the FMA path's inputs): on 65,536 lanes of a fixed
// pseudo-random draw, sums of either sign among them. Computed once.
bool bf16_dot_is_two_fmas() {
#if defined(SERVAL_BF16_DOT_KERNEL)
  static const bool same = [] {
    uint64_t state = 0x9E3779B97F4A7C15ull;
    auto next = [&] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<uint32_t>(state >> 33);
    };
    auto bf16 = [](float v) { uint32_t u; std::memcpy(&u, &v, 4); return static_cast<uint16_t>(u >> 16); };
    auto value = [](uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float v; std::memcpy(&v, &u, 4); return v; };
    for (int round = 0; round < 4096; ++round) {
      alignas(64) uint16_t codes[32], x[32];
      alignas(64) float t[16], got[16];
      for (int i = 0; i < 32; ++i) {
        codes[i] = bf16(static_cast<float>(static_cast<int>(next() % 256) - (round % 2 ? 128 : 0)));
        const int scale = static_cast<int>(next() % 201) - 100;  // 2^-100 .. 2^100
        x[i] = next() % 16 == 0 ? 0 : bf16(std::ldexp(static_cast<float>(next() % 256 + 1) / 256.f, scale) *
                                           (next() % 2 ? 1.f : -1.f));
      }
      for (int j = 0; j < 16; ++j) t[j] = std::ldexp(static_cast<float>(static_cast<int32_t>(next())) / 2147483648.f,
                                                     static_cast<int>(next() % 201) - 100);
      _mm512_store_ps(got, _mm512_dpbf16_ps(_mm512_load_ps(t), (__m512bh)_mm512_load_si512(codes),
                                            (__m512bh)_mm512_load_si512(x)));
      for (int j = 0; j < 16; ++j) {
        const float want = std::fma(value(codes[2 * j]), value(x[2 * j]),
                                    std::fma(value(codes[2 * j + 1]), value(x[2 * j + 1]), t[j]));
        if (std::memcmp(&want, &got[j], 4) != 0) return false;
      }
    }
    return true;
  }();
  return same;
#else
  return false;
#endif
}

// From how many rows block_panel_linear_bf16_dot takes its FMA path (0: never); refused where the bits would differ.
void set_bf16_dot_fma_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_bf16_dot_fma_rows: rows must be >= 0, not ", rows);
  TORCH_CHECK(rows == 0 || bf16_dot_is_two_fmas(), "set_bf16_dot_fma_rows: this CPU's vdpbf16ps is not two FMAs");
#if defined(SERVAL_BF16_DOT_KERNEL)
  fma_steps_from_rows = rows == 0 ? INT64_MAX : rows;
#endif
}

// Whether block_panel_linear_bf16_dot can run on AMX tiles here (its ``tiles``).
bool bf16_dot_tiles_available() {
#if defined(SERVAL_BF16_TILES)
  return amx_bf16_usable();
#else
  return false;
#endif
}

// x [M, K] bfloat16; panels and scales of format q4, q4k, q6k or q8 as block_panel_linear takes them. Returns y [M, N]
// bfloat16, or float32 with float_output. With tiles, on AMX tiles for every row count (refused where they cannot
// run): a linear's choice for all its calls, since their bits differ from the vectors'.
at::Tensor block_panel_linear_bf16_dot(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                                       const std::string& format, int64_t out_features, bool float_output,
                                       bool tiles) {
  TORCH_CHECK(!tiles || bf16_dot_tiles_available(), "block_panel_linear_bf16_dot: no AMX-BF16 tiles on this CPU or "
              "build");
  const BlockCall call = check_block_call(x, panels, scales, format, out_features);
  TORCH_CHECK(call.format == kQ4 || call.format == kQ4K || call.format == kQ6K || call.format == kQ8,
              "block_panel_linear_bf16_dot: q4, q4k, q6k or q8 blocks, not ", format);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "block_panel_linear_bf16_dot: x must be bfloat16");
#if defined(SERVAL_BF16_DOT_KERNEL)
  const int64_t M = call.rows, K = call.in_features, N = call.out_features, G = call.groups, padded = G * kBlock;
  const at::Tensor xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  uint16_t* rows = reinterpret_cast<uint16_t*>(serval::scratch(1, (M * padded + 1) / 2));
  flush_tiny_rows(xs, M, K, padded, rows);  // and padded with zeros to the blocks' width
  xs = rows;
  const int64_t ldx = padded;
  float* xsum = serval::scratch(2, M * G * 2);
  if (call.format == kQ6K) half_block_sums(xs, M, ldx, G, xsum);
  else if (call.format != kQ8) block_sums(xs, M, ldx, G, xsum);
  if (call.format != kQ8) {
    uint16_t* permuted = reinterpret_cast<uint16_t*>(serval::scratch(3, (M * padded + 1) / 2));
    permuted_rows(xs, M, ldx, padded, permuted);
    xs = permuted;
  }
  float* xf = nullptr;
  if (!tiles && M >= fma_steps_from_rows.load(std::memory_order_relaxed)) {
    xf = serval::scratch(4, M * padded);
    widen_rows(xs, M * padded, xf);
  }
  const Panels w{panels.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.data_ptr()), G,
                 block_rows(call.format) * 16, scale_rows(call.format) * 16 * 2, super_bytes(call.format)};
  auto run = [&](auto* y) {
#if defined(SERVAL_BF16_TILES)
    if (tiles) {
      if (call.format == kQ4) gemm_by_tiles<kQ4>(xs, M, ldx, xsum, w, N, y);
      else if (call.format == kQ4K) gemm_by_tiles<kQ4K>(xs, M, ldx, xsum, w, N, y);
      else if (call.format == kQ6K) {
        uint16_t* split = reinterpret_cast<uint16_t*>(serval::scratch(4, M * padded));  // xf's slot: unused here
        split_halves(xs, M, ldx, split);
        gemm_by_tiles<kQ6K>(split, M, ldx, xsum, w, N, y);
      }
      else gemm_by_tiles<kQ8>(xs, M, ldx, xsum, w, N, y);
      return;
    }
#endif
    if (xf != nullptr) {
      if (call.format == kQ4) gemm_by_fmas<kQ4>(xf, M, ldx, xsum, w, N, y);
      else if (call.format == kQ4K) gemm_by_fmas<kQ4K>(xf, M, ldx, xsum, w, N, y);
      else if (call.format == kQ6K) gemm_by_fmas<kQ6K>(xf, M, ldx, xsum, w, N, y);
      else gemm_by_fmas<kQ8>(xf, M, ldx, xsum, w, N, y);
      return;
    }
    if (call.format == kQ4) gemm<kQ4>(xs, M, ldx, xsum, w, N, y);
    else if (call.format == kQ4K) gemm<kQ4K>(xs, M, ldx, xsum, w, N, y);
    else if (call.format == kQ6K) gemm<kQ6K>(xs, M, ldx, xsum, w, N, y);
    else gemm<kQ8>(xs, M, ldx, xsum, w, N, y);
  };
  if (float_output) {
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
    run(y.data_ptr<float>());
    return y;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
#else
  TORCH_CHECK(false, "block_panel_linear_bf16_dot needs AVX-512 BF16 (check block_bf16_dot_kernel_available())");
#endif
}
