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

/* A Q4_K / Q5_K super-block's 8 scales as int16 (in both lanes) and its 8 minima times dmin */
AVX2 static INLINE void k4_header(const uint8_t* w, __m256i* scales, __m256* minima) {
  uint32_t sm[4];
  k4_scales(w + 4, sm);
  const __m128i both = _mm_loadu_si128((const __m128i*)sm); /* scales, then minima */
  const __m128i scales8 = _mm_cvtepu8_epi16(both);
  *scales = _mm256_set_m128i(scales8, scales8);
  *minima = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(*(const uint16_t*)(w + 2))),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))));
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
