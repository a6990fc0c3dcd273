/* The AVX2 activation rounding, the run-time check for AVX2, and the int8 rate probe (x86-64). */
#if defined(__x86_64__) || defined(_M_X64)
#include "gguf_avx2_parts.h"
#include "mac_rate.h"
#include "portable.h"

/* the same levels as the portable rule: x * (127 / amax) in float32, rounded half to even (MXCSR's default) */
AVX2 void quantize_act_row_avx2(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int b = 0; b < k / act_block; b++) {
    const float* xb = x + b * act_block;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < act_block; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    d[b] = amax / 127.0f;
    for (int i = 0; i < act_block; i += 32) {
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), inv));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), inv));
      const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), inv));
      /* packs interleave the 128-bit lanes: the permute puts the 32 levels back in order */
      const __m256i levels = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), order);
      _mm256_storeu_si256((__m256i*)(q + b * act_block + i), levels);
      /* the two 16s' level sums: pairs, fours, then within each lane */
      __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, levels), ones16);
      t = _mm256_hadd_epi32(t, t);
      t = _mm256_hadd_epi32(t, t);
      const int s = (b * act_block + i) / 16;
      sums[s] = (int16_t)_mm256_extract_epi32(t, 0);
      sums[s + 1] = (int16_t)_mm256_extract_epi32(t, 4);
    }
  }
}

struct avx2_probe {
  const int8_t* x;
  __m256i acc[PROBE_ROWS];
};

AVX2 static void avx2_probe_pass(void* state) {
  struct avx2_probe* p = state;
  const __m256i levels = _mm256_set1_epi8(11), scale = _mm256_set1_epi16(3);
  __m256i acc[PROBE_ROWS]; /* in registers through the pass (the activations are chars: they may alias p) */
  for (int r = 0; r < PROBE_ROWS; r++) acc[r] = p->acc[r];
  for (int i = 0; i < PROBE_K; i += 64) {
    for (int r = 0; r < PROBE_ROWS; r++) {
      const int8_t* x = p->x + r * PROBE_K + i;
      const __m256i p0 = _mm256_maddubs_epi16(levels, _mm256_loadu_si256((const __m256i*)x));
      const __m256i p1 = _mm256_maddubs_epi16(levels, _mm256_loadu_si256((const __m256i*)(x + 32)));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(p0, scale), _mm256_madd_epi16(p1, scale)));
    }
  }
  for (int r = 0; r < PROBE_ROWS; r++) p->acc[r] = acc[r];
}

AVX2 static double int8_mac_rate_avx2(double seconds) {
  struct avx2_probe probe;
  probe.x = probe_activations();
  return timed_mac_rate(seconds, avx2_probe_pass, &probe, probe.acc, sizeof probe.acc);
}

/* The calling thread's int8 multiply-accumulate rate through the instructions every dot here is built from
 * (maddubs into int16 pairs, madd into int32, add), the activations read from L1 as the dots read them: the ceiling
 * the bench sets a prompt's achieved rate against. MACs per second of the thread's own CPU time (other processes
 * sharing the core do not lower it) over about `seconds` of it; 0 without AVX2. */
STATICLM_EXPORT double staticlm_int8_mac_rate(double seconds) {
  if (!have_avx2()) return 0.0;
  return int8_mac_rate_avx2(seconds);
}

#if defined(_WIN32)
#include <intrin.h>
/* CPUID itself (MSVC and clang-cl have no __builtin_cpu_supports runtime): FMA, AVX, F16C and the OS saving the
 * YMM registers (leaf 1, XGETBV), AVX2 (leaf 7) */
static int cpu_has_avx2(void) {
  int r[4];
  __cpuid(r, 1);
  const int ecx = r[2];
  if (!((ecx >> 12) & 1) || !((ecx >> 27) & 1) || !((ecx >> 28) & 1) || !((ecx >> 29) & 1)) return 0;
  if ((_xgetbv(0) & 6) != 6) return 0;
  __cpuidex(r, 7, 0);
  return (r[1] >> 5) & 1;
}
#else
#include <cpuid.h>
static int cpu_has_avx2(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
  unsigned int eax, ebx, ecx, edx; /* F16C from CPUID leaf 1: Clang's __builtin_cpu_supports does not know it */
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 29) & 1);
}
#endif

int have_avx2(void) {
  static int cached = -1;
  if (cached < 0) cached = cpu_has_avx2();
  return cached;
}
#else
typedef int gguf_avx2_is_x86_only; /* an empty translation unit elsewhere */
#endif
