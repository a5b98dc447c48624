// One row through the AVX2 build's float32 block kernel (csrc/panel_linear.cpp tile_inline), on one core, in cache:
// whether its time is the FMA chains' latency or the weights' decoding. A standalone probe, not Serval's kernel: the
// same work per pair of input positions and 8 columns (a byte row widened to 32-bit lanes, a mask and a shift, two
// conversions to float32, two FMAs for w = d q + m, two FMAs into the sums), on a 4-bit panel of 16 columns.
//
//     g++ -O3 -march=native -o /tmp/avx2_q4_one_row benchmarks/probes/avx2_q4_one_row.cpp && /tmp/avx2_q4_one_row 256
//
// Needs AVX2 and FMA. Prints weights per ns for T tiles at once (T = 1: two FMA chains in flight, as the kernel
// has; 2 and 4: four and eight, each output's chain unchanged) and with the conversions done by the magic-number
// trick (an OR and a subtraction) instead of vcvtdq2ps. The argument is the columns (256: 0.39 MB, in L2).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
using Vec = __m256;
static inline __m256i widen(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
// panel layout: per tile (16 cols), per block g: 16 pair rows of 16 bytes (256 B); scales d,m float per col
template <int T, int MAGIC>
__attribute__((noinline)) void run(const uint8_t* q, const float* sc, const float* x, int tiles, int groups, float* y) {
  for (int tile = 0; tile < tiles; tile += T) {
    Vec acc[2 * T];
    for (int c = 0; c < 2 * T; ++c) acc[c] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      const uint8_t* qc[2 * T]; Vec d[2 * T], m[2 * T];
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < 2; ++c) {
          const int64_t b = ((int64_t)(tile + t) * groups + g);
          qc[2 * t + c] = q + b * 256 + c * 8;
          d[2 * t + c] = _mm256_loadu_ps(sc + b * 32 + c * 8);
          m[2 * t + c] = _mm256_loadu_ps(sc + b * 32 + 16 + c * 8);
        }
      const float* xg = x + g * 32;
      for (int pair = 0; pair < 16; ++pair) {
        Vec ev[2 * T], od[2 * T];
        for (int c = 0; c < 2 * T; ++c) {
          __m256i b = widen(qc[c] + pair * 16);
          __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(b, 4);
          Vec flo, fhi;
          if (MAGIC) {
            const __m256i mg = _mm256_set1_epi32(0x4B000000); const Vec mf = _mm256_set1_ps(8388608.f);
            flo = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(lo, mg)), mf);
            fhi = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(hi, mg)), mf);
          } else { flo = _mm256_cvtepi32_ps(lo); fhi = _mm256_cvtepi32_ps(hi); }
          ev[c] = _mm256_fmadd_ps(flo, d[c], m[c]);
          od[c] = _mm256_fmadd_ps(fhi, d[c], m[c]);
        }
        const Vec xe = _mm256_broadcast_ss(xg + 2 * pair), xo = _mm256_broadcast_ss(xg + 2 * pair + 1);
        for (int c = 0; c < 2 * T; ++c) acc[c] = _mm256_fmadd_ps(xo, od[c], _mm256_fmadd_ps(xe, ev[c], acc[c]));
      }
    }
    for (int c = 0; c < 2 * T; ++c) _mm256_storeu_ps(y + tile * 16 + c * 8, acc[c]);
  }
}
template <int T, int M> void bench(const char* name, const uint8_t* q, const float* sc, const float* x, int tiles, int groups, float* y) {
  double best = 1e9;
  for (int r = 0; r < 30; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    run<T, M>(q, sc, x, tiles, groups, y);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  printf("%-12s %.2f Gweights/s  y0=%g\n", name, (double)tiles * 16 * groups * 32 / best / 1e9, y[5]);
}
int main(int argc, char** argv) {
  const int K = 2048, N = argc > 1 ? atoi(argv[1]) : 1024, groups = K / 32, tiles = N / 16;
  uint8_t* q = (uint8_t*)aligned_alloc(64, (size_t)tiles * groups * 256);
  float* sc = (float*)aligned_alloc(64, (size_t)tiles * groups * 32 * 4);
  float* x = (float*)aligned_alloc(64, K * 4); float* y = (float*)aligned_alloc(64, N * 4);
  for (size_t i = 0; i < (size_t)tiles * groups * 256; ++i) q[i] = rand();
  for (size_t i = 0; i < (size_t)tiles * groups * 32; ++i) sc[i] = rand() / (float)RAND_MAX;
  for (int i = 0; i < K; ++i) x[i] = rand() / (float)RAND_MAX;
  printf("matrix %.2f MB\n", tiles * groups * (256 + 128) / 1e6);
  for (int rep = 0; rep < 2; ++rep) {
  bench<1, 0>("T1 cvt", q, sc, x, tiles, groups, y);
  bench<2, 0>("T2 cvt", q, sc, x, tiles, groups, y);
  bench<4, 0>("T4 cvt", q, sc, x, tiles, groups, y);
  bench<1, 1>("T1 magic", q, sc, x, tiles, groups, y);
  bench<2, 1>("T2 magic", q, sc, x, tiles, groups, y);
  bench<4, 1>("T4 magic", q, sc, x, tiles, groups, y);
  }
}
