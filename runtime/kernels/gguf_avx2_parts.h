/* The AVX2 kernels' shared pieces (gguf_avx2*.c): unpacking levels, spreading scales, summing lanes. x86-64 only. */
#pragma once
#include <immintrin.h>

#include "gguf_avx2.h"
#include "portable.h"

#define AVX2 TARGET_AVX2
#define INLINE ALWAYS_INLINE

AVX2 static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* byte i is 0xFF where bit i of x is set */
AVX2 static inline __m256i bit_bytes(uint32_t x) {
  const __m256i spread = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                            0x0303030303030303);
  const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread), bits), bits);
}

AVX2 static inline __m256i nibbles32(const uint8_t* p) { /* 16 bytes -> 32 levels: low nibbles, then high */
  const __m128i raw = _mm_loadu_si128((const __m128i*)p);
  const __m128i m4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

#define K4_BLOCK_BYTES(five) ((five) ? 176 : 144) /* a Q5_K or Q4_K super-block */

/* A Q4_K / Q5_K super-block's 8 scales as int16 (in both lanes), its 8 minima times dmin, and Q5_K's 32 bytes of
 * high bits (zero for Q4_K); returns its 128 bytes of low levels (k4_chunk unpacks them) */
AVX2 static INLINE const uint8_t* k4_header(const uint8_t* w, int five, __m256i* scales, __m256* minima,
                                            __m256i* qh) {
  uint32_t sm[4];
  k4_scales(w + 4, sm);
  const __m128i both = _mm_loadu_si128((const __m128i*)sm); /* scales, then minima */
  const __m128i scales8 = _mm_cvtepu8_epi16(both);
  *scales = _mm256_set_m128i(scales8, scales8);
  *minima = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(*(const uint16_t*)(w + 2))),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))));
  *qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
  return w + (five ? 48 : 16);
}

/* chunk c of a Q4_K / Q5_K super-block's levels (qs, qh: k4_header's): sub-block 2c's 32 levels in *lo, sub-block
 * 2c + 1's in *hi, each level's fifth bit from qh for Q5_K */
AVX2 static INLINE void k4_chunk(const uint8_t* qs, __m256i qh, int c, int five, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
  *lo = _mm256_and_si256(raw, m4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  if (five) {
    *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
    *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
  }
}

/* Q6_K's 6-bit levels of 32 bytes of low nibbles each (l0, l1) and their 32 bytes of high bit pairs (h), as the file
 * holds half of a super-block (or a group block's part of it): q[0] = l0's low nibbles with h's bits 0-1, q[1] = l1's
 * with bits 2-3, q[2] = l0's high nibbles with bits 4-5, q[3] = l1's with bits 6-7 */
AVX2 static INLINE void q6_levels(__m256i l0, __m256i l1, __m256i h, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
}

/* Half t of a Q6_K super-block (w: its start; sc16: its 16 scales as int16): the levels of its 4 parts of 32
 * (q6_levels) in q; returns its 8 scales in both lanes */
AVX2 static INLINE __m256i q6_half(const uint8_t* w, int half, __m256i sc16, __m256i q[4]) {
  const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
  q6_levels(_mm256_loadu_si256((const __m256i*)ql), _mm256_loadu_si256((const __m256i*)(ql + 32)),
            _mm256_loadu_si256((const __m256i*)qh), q);
  return half ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
}

/* masks for _mm256_shuffle_epi8 that copy one int16 of a lane to all eight of that lane */
AVX2 static INLINE __m256i broadcast16(int low_lane_index, int high_lane_index) {
  const __m128i lo = _mm_set1_epi16((short)(low_lane_index * 2 | (low_lane_index * 2 + 1) << 8));
  const __m128i hi = _mm_set1_epi16((short)(high_lane_index * 2 | (high_lane_index * 2 + 1) << 8));
  return _mm256_set_m128i(hi, lo);
}

/* one function per type and tile height (a DotFn or GroupDotFn), so each loop over rows has a constant count */
#define TILED(name, call)                                                                                    \
  AVX2 static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) { \
    BY_COUNT(rows, call)                                                                                     \
  }

/* For each type of list (ROW_DOT_TYPES or GROUP_DOT_TYPES, gguf_dot.h): avx2_<name>, the TILED function of the file's
 * CALL_<name>(n); then the function declared by signature (its parameter: int type), which returns the type's one or
 * NULL */
#define AVX2_TILED(type, name) TILED(avx2_##name, CALL_##name)
#define AVX2_CASE(type, name) \
  case type: return avx2_##name;
#define AVX2_BY_TYPE(list, signature) \
  list(AVX2_TILED) signature {        \
    switch (type) { list(AVX2_CASE) } \
    return NULL;                      \
  }
