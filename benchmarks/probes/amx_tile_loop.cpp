// Where one row's time goes in the AMX tiles' loop (csrc/bf16_dot_linear.cpp tiles_range), on one core, in cache,
// and whether a vector path could give the tiles' bits. A standalone probe, not Serval's kernel: the same kinds of
// work per unit (a block of 32 positions for one panel of 16 columns, 256 bytes of 4-bit codes).
//
//     g++ -O2 -march=native -o /tmp/amx_tile_loop benchmarks/probes/amx_tile_loop.cpp && /tmp/amx_tile_loop
//
// Needs AMX-BF16 (Intel Sapphire Rapids and later) and Linux. Prints ns per unit for:
// - "tile loop": decode unit u + 1's codes into a B tile, u's dot product, u - 1's sums and float steps (the kernel's
//   three-stage pipeline with two C tiles);
// - "deeper": the same with four C tiles, the sums stored three units after their dot product;
// - "decode only": the codes into the B tile (a byte permutation, shifts and masks, sixteen 64-byte stores);
// - "stores only": the sixteen stores;
// and the lanes where TDPBF16PS's sums differ from a chain of VDPBF16PS over the same pairs, first to last or last
// to first (bfloat16 codes 128..143 against random bfloat16 activations).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#define TILES __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vbmi,avx512bf16,f16c")))

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, 1, 6, 7: C (1 row); tmm2, 3: A (1 row); tmm4, 5: B (16 rows of 16 bfloat16 pairs).
TILES void configure_one_row() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.bytes_per_row[t] = 64;
    cfg.rows[t] = t == 4 || t == 5 ? 16 : 1;
  }
  _tile_loadconfig(&cfg);
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

constexpr int64_t kUnits = 4000000, kUnitsPerTile = 128;  // 64 blocks of 32 positions, two panels
alignas(64) uint8_t codes[1 << 16];                          // 64 KiB of codes: in L2
alignas(64) uint8_t scales[1 << 14];
alignas(64) uint16_t activations[64 * 32];
volatile float sink;

// A unit's codes as a B tile: 4 rows of 16 bytes at a time, transposed by one byte permutation, each nibble joined
// to 0x4300 (bfloat16 128 + q) by a shift and a ternary logic op, as four_pair_codes does.
TILES inline void decode(const uint8_t* q, uint8_t* b) {
  const __m512i low_bits = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  const __m512i order = _mm512_set1_epi32(0x03020100);
  for (int p = 0; p < 16; p += 4) {
    const __m512i columns = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(q + p * 16));
    for (int k = 0; k < 4; ++k)
      _mm512_store_si512(reinterpret_cast<__m512i*>(b + 64 * (p + k)),
                         _mm512_ternarylogic_epi32(k ? _mm512_srli_epi32(columns, 4 * k) : columns, low_bits, bias,
                                                   0xEA));
  }
}

// The float steps of a unit's sums: its scales from float16, two FMAs into the row's accumulator.
TILES inline void steps(int64_t u, const float* sums, float* acc) {
  const uint8_t* s = scales + ((u * 64) & 0x3FFF);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  const __m512 offset = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.f),
                                        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32))));
  float* out = acc + (u & 1) * 16;
  __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(sums), _mm512_load_ps(out));
  _mm512_store_ps(out, _mm512_fmadd_ps(offset, _mm512_set1_ps(1.5f), v));
}

template <int S>
TILES inline void dot(int64_t u, const uint8_t* b) {
  const uint16_t* a = activations + (u / 2 % 64) * 32;
  if constexpr (S == 0) { _tile_zero(0); _tile_loadd(2, a, 64); _tile_loadd(4, b, 64); _tile_dpbf16ps(0, 2, 4); }
  if constexpr (S == 1) { _tile_zero(1); _tile_loadd(3, a, 64); _tile_loadd(5, b, 64); _tile_dpbf16ps(1, 3, 5); }
  if constexpr (S == 2) { _tile_zero(6); _tile_loadd(2, a, 64); _tile_loadd(4, b, 64); _tile_dpbf16ps(6, 2, 4); }
  if constexpr (S == 3) { _tile_zero(7); _tile_loadd(3, a, 64); _tile_loadd(5, b, 64); _tile_dpbf16ps(7, 3, 5); }
}

template <int S>
TILES inline void store_sums(float* out) {
  if constexpr (S == 0) _tile_stored(0, out, 64);
  if constexpr (S == 1) _tile_stored(1, out, 64);
  if constexpr (S == 2) _tile_stored(6, out, 64);
  if constexpr (S == 3) _tile_stored(7, out, 64);
  asm volatile("" ::: "memory");
}

TILES double tile_loop() {
  alignas(64) uint8_t b[2][1024];
  alignas(64) float sums[2][16], acc[32] = {};
  const double start = now();
  for (int64_t base = 0; base < kUnits; base += kUnitsPerTile) {
    decode(codes + (base * 256 & 0xFFFF), b[0]);
    for (int64_t u = 0; u < kUnitsPerTile; u += 2) {
      decode(codes + ((base + u + 1) * 256 & 0xFFFF), b[1]);
      asm volatile("" ::: "memory");
      dot<0>(u, b[0]);
      if (u > 0) { store_sums<1>(sums[1]); steps(u - 1, sums[1], acc); }
      if (u + 2 < kUnitsPerTile) decode(codes + ((base + u + 2) * 256 & 0xFFFF), b[0]);
      asm volatile("" ::: "memory");
      dot<1>(u + 1, b[1]);
      store_sums<0>(sums[0]);
      steps(u, sums[0], acc);
    }
    store_sums<1>(sums[1]);
    steps(kUnitsPerTile - 1, sums[1], acc);
  }
  sink = acc[3];
  return (now() - start) / kUnits * 1e9;
}

TILES double deeper() {
  alignas(64) uint8_t b[2][1024];
  alignas(64) float sums[4][16], acc[32] = {};
  const double start = now();
  for (int64_t base = 0; base < kUnits; base += kUnitsPerTile) {
    decode(codes + (base * 256 & 0xFFFF), b[0]);
    for (int64_t u = 0; u < kUnitsPerTile; u += 4) {
      for (int i = 0; i < 4; ++i) {  // unit u + i: decode the next, dot this one, store the sums of three before
        const int64_t v = u + i;
        if (v + 1 < kUnitsPerTile) decode(codes + ((base + v + 1) * 256 & 0xFFFF), b[(v + 1) & 1]);
        asm volatile("" ::: "memory");
        if (i == 0) dot<0>(v, b[0]); else if (i == 1) dot<1>(v, b[1]); else if (i == 2) dot<2>(v, b[0]); else dot<3>(v, b[1]);
        if (v >= 3) {
          const int64_t w = v - 3;
          if (w % 4 == 0) store_sums<0>(sums[0]); else if (w % 4 == 1) store_sums<1>(sums[1]);
          else if (w % 4 == 2) store_sums<2>(sums[2]); else store_sums<3>(sums[3]);
          steps(w, sums[w % 4], acc);
        }
      }
    }
  }
  sink = acc[3];
  return (now() - start) / kUnits * 1e9;
}

TILES double decode_only() {
  alignas(64) uint8_t b[2][1024];
  const double start = now();
  for (int64_t u = 0; u < kUnits; ++u) {
    decode(codes + (u * 256 & 0xFFFF), b[u & 1]);
    asm volatile("" ::: "memory");
  }
  return (now() - start) / kUnits * 1e9;
}

TILES double stores_only() {
  alignas(64) uint8_t b[2][1024];
  const __m512i value = _mm512_set1_epi32(3);
  const double start = now();
  for (int64_t u = 0; u < kUnits; ++u) {
    for (int i = 0; i < 16; ++i) _mm512_store_si512(reinterpret_cast<__m512i*>(b[u & 1] + 64 * i), value);
    asm volatile("" ::: "memory");
  }
  return (now() - start) / kUnits * 1e9;
}

uint16_t bfloat16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Lanes where the tile's sum of 16 pairs differs from VDPBF16PS chained over them (first to last, last to first).
TILES void compare_bits() {
  std::mt19937_64 rng(1);
  alignas(64) uint16_t a[32], b[16 * 32];
  alignas(64) float tile[16], forward[16], backward[16];
  long lanes = 0, differ_forward = 0, differ_backward = 0;
  for (int trial = 0; trial < 100000; ++trial) {
    for (auto& x : a) {
      const float v = std::ldexp(static_cast<float>(rng() % 256 + 1) / 256.f, static_cast<int>(rng() % 60) - 30);
      x = rng() % 16 == 0 ? 0 : bfloat16(rng() & 1 ? v : -v);
    }
    for (auto& c : b) c = bfloat16(static_cast<float>(128 + rng() % 16));
    _tile_zero(0);
    _tile_loadd(2, a, 64);
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, tile, 64);
    __m512 f = _mm512_setzero_ps(), r = _mm512_setzero_ps();
    for (int k = 0; k < 16; ++k) {
      int32_t pair_f, pair_r;
      std::memcpy(&pair_f, a + 2 * k, 4);
      std::memcpy(&pair_r, a + 2 * (15 - k), 4);
      f = _mm512_dpbf16_ps(f, (__m512bh)_mm512_load_si512(b + 32 * k), (__m512bh)_mm512_set1_epi32(pair_f));
      r = _mm512_dpbf16_ps(r, (__m512bh)_mm512_load_si512(b + 32 * (15 - k)), (__m512bh)_mm512_set1_epi32(pair_r));
    }
    _mm512_store_ps(forward, f);
    _mm512_store_ps(backward, r);
    for (int n = 0; n < 16; ++n) {
      ++lanes;
      differ_forward += std::memcmp(&tile[n], &forward[n], 4) != 0;
      differ_backward += std::memcmp(&tile[n], &backward[n], 4) != 0;
    }
  }
  std::printf("tile sums against a vdpbf16ps chain: %ld lanes, %ld differ (first to last), %ld (last to first)\n", lanes,
              differ_forward, differ_backward);
}

}  // namespace

int main() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) {
    std::printf("no AMX tile data permission here\n");
    return 1;
  }
  for (int i = 0; i < (1 << 16); ++i) codes[i] = static_cast<uint8_t>(i * 7);
  for (int i = 0; i < (1 << 14); ++i) scales[i] = static_cast<uint8_t>((i * 13) & 0x3F);
  for (int i = 0; i < 64 * 32; ++i) activations[i] = bfloat16(static_cast<float>(i % 7) - 3.f);
  configure_one_row();
  for (int round = 0; round < 3; ++round)
    std::printf("ns a unit: tile loop %.1f, deeper %.1f, decode only %.1f, stores only %.1f\n", tile_loop(), deeper(),
                decode_only(), stores_only());
  compare_bits();
  _tile_release();
  return 0;
}
