/* attend(): one query position's g heads against the rows it sees (attention.h). AVX2 where the CPU has it, else
 * portable C; either way each score, the softmax and each output sum run over the rows in their given order, so a
 * row's result is a function of its inputs alone. */
#include "attention.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include "gguf_avx2_parts.h"
#endif

#define GROUP_VECTORS 8 /* query vectors that share each key and value row read */

int64_t attention_scratch(int num_vectors, int n, int d) {
  return (int64_t)num_vectors * ((n + 7) & ~7) + 2 * (int64_t)d + num_vectors;
}

static float half_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: normalize */
    int e = -1;
    uint32_t m = mantissa;
    do { e++; m <<= 1; } while ((m & 1024) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static uint16_t half_bits(float f) { /* round to nearest even, as F16C's cvtps_ph does */
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  if (x >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0));
  if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half */
  if (x < 0x38800000) { /* a subnormal half (or zero): units of 2^-24, rounded to even by the FPU's default mode */
    float a;
    memcpy(&a, &x, sizeof a);
    return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
  }
  uint32_t h = ((x >> 13) - (112 << 10)) & 0xffff;
  const uint32_t rest = x & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

static const float* row_of(const void* p, int d, int half, float* buffer) {
  if (!half) return p;
  for (int c = 0; c < d; c++) buffer[c] = half_value(((const uint16_t*)p)[c]);
  return buffer;
}

/* Both versions: each score is one product chain over d in order; the softmax is over a vector's own rows; each
 * output element sums p_j v_j in row order from zero (a vector's rows past its count weigh 0: adding 0 changes no
 * bit), then is scaled by 1 / sum. */
static void attend_portable(const float* const* q, const int* counts, int num_vectors, int d, float scale,
                            const void* const* keys, const void* const* values, int n, int half, float* scratch,
                            float* const* out) {
  const int n8 = (n + 7) & ~7;
  float *row = scratch + (int64_t)num_vectors * n8, *inv = row + 2 * d;
  for (int j = 0; j < n; j++) {
    const float* k = row_of(keys[j], d, half, row);
    for (int p = 0; p < num_vectors; p++) {
      float s = 0.0f;
      for (int c = 0; c < d; c++) s = fmaf(q[p][c], k[c], s);
      scratch[p * n8 + j] = s * scale;
    }
  }
  for (int p = 0; p < num_vectors; p++) {
    float* s = scratch + p * n8;
    float m = -INFINITY, sum = 0.0f;
    for (int j = 0; j < counts[p]; j++) m = s[j] > m ? s[j] : m;
    for (int j = 0; j < counts[p]; j++) sum += s[j] = expf(s[j] - m);
    for (int j = counts[p]; j < n; j++) s[j] = 0.0f;
    inv[p] = 1.0f / sum;
    memset(out[p], 0, sizeof(float) * (size_t)d);
  }
  for (int j = 0; j < n; j++) {
    const float* v = row_of(values[j], d, half, row + d);
    for (int p = 0; p < num_vectors; p++) {
      for (int c = 0; c < d; c++) out[p][c] = fmaf(scratch[p * n8 + j], v[c], out[p][c]);
    }
  }
  for (int p = 0; p < num_vectors; p++) {
    for (int c = 0; c < d; c++) out[p][c] *= counts[p] ? inv[p] : 0.0f;
  }
}

#if defined(__x86_64__) || defined(_M_X64)
AVX2 static inline __m256 load_row(const void* p, int c, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + c)))
              : _mm256_loadu_ps((const float*)p + c);
}

/* e^x for x <= 0 (a score minus the largest): 0 below float's range, else 2^i e^r with |r| <= ln2 / 2 by a degree-6
 * polynomial (about 1e-7 relative) */
AVX2 static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 in_range = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 i = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(i, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(i, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), in_range);
}

AVX2 static inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/* scores s[p][j] = scale q[p] . k_j for G vectors and rows 0..n: each key row read once for the G vectors */
AVX2 static ALWAYS_INLINE void group_scores(const float* const* q, int G, int d, float scale,
                                                                    const void* const* keys, int n, int half,
                                                                    float* const* s) {
  for (int j = 0; j < n; j++) {
    const void* k = keys[j];
    __m256 acc[GROUP_VECTORS];
    for (int p = 0; p < G; p++) acc[p] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      const __m256 kk = load_row(k, c, half);
      for (int p = 0; p < G; p++) acc[p] = _mm256_fmadd_ps(_mm256_loadu_ps(q[p] + c), kk, acc[p]);
    }
    for (int p = 0; p < G; p++) s[p][j] = hsum(acc[p]) * scale;
  }
}

/* out[p] = inv[p] sum_j s[p][j] v_j for G vectors: each value row read once for the G vectors */
AVX2 static ALWAYS_INLINE void group_values(float* const* s, const float* inv, int G, int d,
                                                                    const void* const* values, int n, int half,
                                                                    float* const* out) {
  for (int c = 0; c < d; c += 8) {
    __m256 acc[GROUP_VECTORS];
    for (int p = 0; p < G; p++) acc[p] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
      const __m256 v = load_row(values[j], c, half);
      for (int p = 0; p < G; p++) acc[p] = _mm256_fmadd_ps(_mm256_broadcast_ss(s[p] + j), v, acc[p]);
    }
    for (int p = 0; p < G; p++) _mm256_storeu_ps(out[p] + c, _mm256_mul_ps(acc[p], _mm256_set1_ps(inv[p])));
  }
}

/* d a multiple of 8 */
AVX2 static void attend_avx2(const float* const* q, const int* counts, int num_vectors, int d, float scale,
                             const void* const* keys, const void* const* values, int n, int half, float* scratch,
                             float* const* out) {
  const int n8 = (n + 7) & ~7;
  float* inv = scratch + (int64_t)num_vectors * n8 + 2 * d;
  float* s[GROUP_VECTORS];
  for (int p0 = 0; p0 < num_vectors; p0 += GROUP_VECTORS) {
    const int G = num_vectors - p0 < GROUP_VECTORS ? num_vectors - p0 : GROUP_VECTORS;
    int most = 0; /* the group's rows: the most any of its vectors sees */
    for (int p = 0; p < G; p++) {
      s[p] = scratch + (int64_t)(p0 + p) * n8;
      most = counts[p0 + p] > most ? counts[p0 + p] : most;
    }
#define SCORES(g) group_scores(q + p0, g, d, scale, keys, most, half, s)
    BY_COUNT(G, SCORES)
#undef SCORES
    for (int p = 0; p < G; p++) { /* softmax over the vector's own rows, padded to whole vectors */
      const int count = counts[p0 + p], count8 = (count + 7) & ~7;
      for (int j = count; j < count8; j++) s[p][j] = -INFINITY;
      __m256 m = _mm256_set1_ps(-INFINITY);
      for (int j = 0; j < count8; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s[p] + j));
      const __m256 top = _mm256_set1_ps(hmax(m));
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < count8; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s[p] + j), top));
        _mm256_storeu_ps(s[p] + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      for (int j = count8; j < most; j++) s[p][j] = 0.0f; /* rows only the group's later vectors see */
      inv[p0 + p] = count ? 1.0f / hsum(sum) : 0.0f;
    }
#define VALUES(g) group_values(s, inv + p0, g, d, values, most, half, out + p0)
    BY_COUNT(G, VALUES)
#undef VALUES
  }
}
#endif

void attend(const float* const* q, const int* counts, int num_vectors, int d, float scale, const void* const* keys,
            const void* const* values, int n, int half, float* scratch, float* const* out) {
#if defined(__x86_64__) || defined(_M_X64)
  if (d % 8 == 0 && have_avx2()) {
    attend_avx2(q, counts, num_vectors, d, scale, keys, values, n, half, scratch, out);
    return;
  }
#endif
  attend_portable(q, counts, num_vectors, d, scale, keys, values, n, half, scratch, out);
}

#if defined(__x86_64__) || defined(_M_X64)
AVX2 static int to_half_avx2(const float* x, int n, uint16_t* y) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128((__m128i*)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  return i;
}
#endif

void to_half(const float* x, int n, uint16_t* y) {
  int i = 0;
#if defined(__x86_64__) || defined(_M_X64)
  if (have_avx2()) i = to_half_avx2(x, n, y);
#endif
  for (; i < n; i++) y[i] = half_bits(x[i]);
}
