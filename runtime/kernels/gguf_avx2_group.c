/* The AVX2 dots of a group of GROUP weight rows stored interleaved (gguf_dot.h), for the 32-input types whose float
 * work per block is the larger part of a dot: a block's conversion and scale multiply-add serve 8 rows at once, and
 * the group's blocks are one stream from memory (8 rows read side by side from a plain matrix are 8 streams, which
 * the hardware's prefetch does not follow in a decode step). */
#if defined(__x86_64__) || defined(_M_X64)
#include "gguf_avx2_parts.h"

/* 8 rows' 32 levels [8] -> 4 eighths x 2 halves of the rows [4, 2] (32 bytes each: 8 levels of 4 rows): rows
 * 0, 1, 4, 5 in the first half, 2, 3, 6, 7 in the second, the order in which hadd_epi32 puts the rows' sums back */
AVX2 static INLINE void interleave_eighths(const __m256i rows[GROUP], __m256i out[4][2]) {
  for (int half = 0; half < 2; half++) {
    const int r = 2 * half; /* rows r, r + 1, r + 4, r + 5 */
    const __m256i a = _mm256_unpacklo_epi64(rows[r], rows[r + 1]), b = _mm256_unpackhi_epi64(rows[r], rows[r + 1]);
    const __m256i c = _mm256_unpacklo_epi64(rows[r + 4], rows[r + 5]);
    const __m256i e = _mm256_unpackhi_epi64(rows[r + 4], rows[r + 5]);
    out[0][half] = _mm256_permute2x128_si256(a, c, 0x20);
    out[1][half] = _mm256_permute2x128_si256(b, e, 0x20);
    out[2][half] = _mm256_permute2x128_si256(a, c, 0x31);
    out[3][half] = _mm256_permute2x128_si256(b, e, 0x31);
  }
}

/* x's 32 levels dotted with 8 weight rows' interleaved levels: [8] int32, one lane per row. Each eighth of x is
 * broadcast against 4 rows' eighths; the products stay in int16 over the 4 eighths (8 products of at most 31 x 127
 * per lane), then int32. */
AVX2 static INLINE __m256i dot_eighths(const __m256i levels[4][2], const int8_t* x) {
  __m256i half_sums[2];
  for (int half = 0; half < 2; half++) {
    __m256i s = _mm256_setzero_si256();
    for (int e = 0; e < 4; e++) {
      int64_t eighth;
      memcpy(&eighth, x + 8 * e, 8);
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(levels[e][half], _mm256_set1_epi64x(eighth)));
    }
    half_sums[half] = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
  }
  return _mm256_hadd_epi32(half_sums[0], half_sums[1]);
}

/* Q4_0, Q5_0 over a group. A block's levels for the 8 rows are unpacked and interleaved once (kept in L1 for the
 * tile's activation rows); each activation row's sums come out as one vector whose lanes are the weight rows, so a
 * block's float work (one conversion, one multiply-add) is shared by the 8 rows rather than done for each, and
 * w = d (q - mid) is taken off exactly in integers. */
AVX2 static INLINE void group_dot_q_0(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                      int64_t stride, const int five) {
  const int bytes = five ? 22 : 18, head = five ? 6 : 2, mid = five ? 16 : 8;
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_0; b++) {
    uint16_t scales[GROUP];
    __m256i q[GROUP], levels[4][2];
    for (int j = 0; j < GROUP; j++) {
      const uint8_t* p = w + (b * GROUP + j) * bytes;
      memcpy(&scales[j], p, 2);
      q[j] = nibbles32(p + head);
      if (five) {
        uint32_t qh;
        memcpy(&qh, p + 2, 4);
        q[j] = _mm256_or_si256(q[j], _mm256_and_si256(bit_bytes(qh), sixteen));
      }
    }
    interleave_eighths(q, levels);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)scales));
    for (int r = 0; r < rows; r++) {
      __m256i sums = dot_eighths(levels, a[r].q + b * 32); /* [8] rows' q . x */
      sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(mid * (a[r].sums[2 * b] + a[r].sums[2 * b + 1])));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(a[r].d[b])), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * stride, acc[r]);
}

#define Q4_0_GROUP(n) group_dot_q_0(w, a, n, k, out, stride, 0)
#define Q5_0_GROUP(n) group_dot_q_0(w, a, n, k, out, stride, 1)
TILED(group_q4_0_avx2, Q4_0_GROUP)
TILED(group_q5_0_avx2, Q5_0_GROUP)

GroupDotFn avx2_group_dot(int type) {
  switch (type) {
    case GGML_Q4_0: return group_q4_0_avx2;
    case GGML_Q5_0: return group_q5_0_avx2;
  }
  return NULL;
}
#else
typedef int gguf_avx2_group_is_x86_only; /* an empty translation unit elsewhere */
#endif
