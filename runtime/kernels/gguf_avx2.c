/* The AVX2 dots and activation rounding (x86-64), picked at run time where the CPU has AVX2, FMA and F16C. */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <time.h>

#include "gguf_avx2.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))

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


AVX2 static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* signed w times signed a, summed in pairs then fours: [8] int32 */
AVX2 static inline __m256i dot_i8(__m256i w, __m256i a) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
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

/* Each vector dot takes a tile of up to TILE activation rows: a weight block is unpacked once for all of them. */
#define INLINE __attribute__((always_inline)) inline

/* Q4_0, Q5_0: unsigned levels q (w = d (q - mid)) dotted as they are, mid times each block's scaled level sum taken
 * off once per row; Q8_0: signed levels, through maddubs(|q|, x sign(q)); one float multiply per block and row */
AVX2 static INLINE void dot_signed_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                        int64_t stride, const int type) {
  const int bytes = type == GGML_Q4_0 ? 18 : type == GGML_Q5_0 ? 22 : 34;
  const float mid = type == GGML_Q4_0 ? 8.0f : type == GGML_Q5_0 ? 16.0f : 0.0f;
  __m256 acc[TILE];
  float offsets[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.0f;
  for (int b = 0; b < k / QK_0; b++, w += bytes) {
    __m256i q;
    if (type == GGML_Q8_0) {
      q = _mm256_loadu_si256((const __m256i*)(w + 2));
    } else if (type == GGML_Q4_0) {
      q = nibbles32(w + 2);
    } else {
      uint32_t qh;
      memcpy(&qh, w + 2, 4);
      q = _mm256_or_si256(nibbles32(w + 6), _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
    }
    const __m256i magnitude = type == GGML_Q8_0 ? _mm256_sign_epi8(q, q) : q;
    const float d = _cvtsh_ss(*(const uint16_t*)w);
    for (int r = 0; r < rows; r++) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(a[r].q + b * 32));
      if (type == GGML_Q8_0) x = _mm256_sign_epi8(x, q);
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(s), acc[r]);
      if (type != GGML_Q8_0) offsets[r] += d * a[r].scaled[b];
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]) - mid * offsets[r];
}

/* Q4_1, Q5_1: unsigned levels, w = d q + m per block: the levels dotted as they are, the block's minimum times each
 * row's scaled level sum (ActRow.scaled) */
AVX2 static INLINE void dot_unsigned_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                          int64_t stride, const int type) {
  const int five = type == GGML_Q5_1;
  const int head = 4 + 4 * five, bytes = head + 16; /* d, m, [qh], then the nibbles */
  __m256 acc[TILE];
  float minima[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), minima[r] = 0.0f;
  for (int b = 0; b < k / QK_0; b++, w += bytes) {
    __m256i q = nibbles32(w + head);
    if (five) {
      uint32_t qh;
      memcpy(&qh, w + 4, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
    }
    const float d = _cvtsh_ss(*(const uint16_t*)w), m = _cvtsh_ss(*(const uint16_t*)(w + 2));
    for (int r = 0; r < rows; r++) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(a[r].q + b * 32));
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(s), acc[r]);
      minima[r] += m * a[r].scaled[b];
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]) + minima[r];
}

/* Q4_K / Q5_K's 12 scale bytes -> 8 scales (bytes 0..7) and 8 minima (bytes 8..15), in 32-bit words */
static INLINE void k4_scales(const uint8_t* packed, uint32_t out[4]) {
  uint32_t u[3];
  memcpy(u, packed, 12);
  out[0] = u[0] & 0x3f3f3f3f;                                           /* scales 0..3: low 6 bits */
  out[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);     /* scales 4..7 */
  out[2] = u[1] & 0x3f3f3f3f;                                           /* minima 0..3 */
  out[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4); /* minima 4..7 */
}

/* masks for _mm256_shuffle_epi8 that copy one int16 of a lane to all eight of that lane */
AVX2 static INLINE __m256i broadcast16(int low_lane_index, int high_lane_index) {
  const __m128i lo = _mm_set1_epi16((short)(low_lane_index * 2 | (low_lane_index * 2 + 1) << 8));
  const __m128i hi = _mm_set1_epi16((short)(high_lane_index * 2 | (high_lane_index * 2 + 1) << 8));
  return _mm256_set_m128i(hi, lo);
}

/* Q4_K / Q5_K: integer sums over a super-block with the 6-bit scales; the minima, as 8 floats per super-block and
 * weight row, dotted with each row's scaled sums in the same accumulator; one float multiply per super-block and row */
AVX2 static INLINE void dot_k4_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                    int64_t stride, const int five) {
  const int bytes = five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  __m256i pick[8];
  for (int j = 0; j < 8; j++) pick[j] = broadcast16(j, j);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += bytes) {
    uint32_t sm[4];
    k4_scales(w + 4, sm);
    const __m128i both = _mm_loadu_si128((const __m128i*)sm); /* scales, then minima */
    const __m128i scales8 = _mm_cvtepu8_epi16(both);
    const __m256i scales = _mm256_set_m128i(scales8, scales8);
    const __m256 minima = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(*(const uint16_t*)(w + 2))),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))));
    const uint8_t* qs = w + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
    __m256i isum[TILE];
    for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC keeps every row's products for one sum at the end, spilled */
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if (five) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      for (int half = 0; half < 2; half++) { /* the rows' 32 low levels, then their 32 high: few registers live */
        const __m256i levels = half ? hi : lo, scale = _mm256_shuffle_epi8(scales, pick[2 * c + half]);
        for (int r = 0; r < rows; r++) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(a[r].q + b * QK_K + 64 * c + 32 * half));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(levels, x), scale));
        }
      }
    }
    const float d = _cvtsh_ss(*(const uint16_t*)w);
    for (int r = 0; r < rows; r++) {
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(minima, _mm256_loadu_ps(a[r].scaled + b * 8), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]);
}

/* The same sums as dot_k4_rows, in the same order, for one activation row (a decode step): a super-block's 8
 * sub-blocks of levels are unpacked at once and stay in registers, and the row's sums need one. Fewer instructions
 * than a tile's pass, but more loads per row: for two rows and more, the tile's pass is faster. */
AVX2 static INLINE void dot_k4_each(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                    int64_t stride, const int five) {
  const int bytes = five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += bytes) {
    uint32_t sm[4];
    k4_scales(w + 4, sm);
    const __m128i both = _mm_loadu_si128((const __m128i*)sm); /* scales, then minima */
    const __m128i scales8 = _mm_cvtepu8_epi16(both);
    const __m256i scales = _mm256_set_m128i(scales8, scales8);
    const __m256 minima = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(*(const uint16_t*)(w + 2))),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8))));
    const uint8_t* qs = w + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(w + 16)) : _mm256_setzero_si256();
    __m256i levels[8], spread[8]; /* [sub-block]: 32 levels; its scale in every int16 */
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      levels[2 * c] = _mm256_and_si256(raw, m4);
      levels[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if (five) {
        levels[2 * c] = _mm256_or_si256(
            levels[2 * c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        levels[2 * c + 1] = _mm256_or_si256(
            levels[2 * c + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
    }
    for (int s = 0; s < 8; s++) spread[s] = _mm256_shuffle_epi8(scales, broadcast16(s, s));
    const float d = _cvtsh_ss(*(const uint16_t*)w);
#pragma GCC unroll 1 /* one row's sums at a time: the levels stay in registers */
    for (int r = 0; r < rows; r++) {
      const int8_t* x = a[r].q + b * QK_K;
      __m256i isum = _mm256_setzero_si256();
      for (int s = 0; s < 8; s++) {
        const __m256i p = _mm256_maddubs_epi16(levels[s], _mm256_loadu_si256((const __m256i*)(x + 32 * s)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, spread[s]));
      }
      __m256 row = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(isum), acc[r]);
      acc[r] = _mm256_fnmadd_ps(minima, _mm256_loadu_ps(a[r].scaled + b * 8), row);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]);
}

AVX2 static INLINE void dot_q6_k_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                      int64_t stride) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  __m256i pick[4]; /* part p of a half: its first 16's scale in the low lane, its second's in the high lane */
  for (int p = 0; p < 4; p++) pick[p] = broadcast16(2 * p, 2 * p + 1);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += 210) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192))); /* [16] int16 */
    __m256i isum[TILE];
    for (int r = 0; r < rows; r++) { /* the levels' offset 32, as -32 sum(sc * level sum) */
      const __m256i sums = _mm256_loadu_si256((const __m256i*)(a[r].sums + b * 16));
      isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
    }
    for (int half = 0; half < 2; half++) {
      const uint8_t *ql = w + 64 * half, *qhp = w + 128 + 32 * half;
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
      const __m256i h = _mm256_loadu_si256((const __m256i*)qhp);
      /* this half's 8 scales in both lanes */
      const __m256i half_scales = half ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                       : _mm256_permute2x128_si256(sc16, sc16, 0x00);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4))};
      for (int part = 0; part < 4; part++) {
        const __m256i scales = _mm256_shuffle_epi8(half_scales, pick[part]);
        for (int r = 0; r < rows; r++) {
          const int8_t* x = a[r].q + b * QK_K + 128 * half + 32 * part;
          const __m256i p = _mm256_maddubs_epi16(q[part], _mm256_loadu_si256((const __m256i*)x));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scales));
        }
      }
    }
    const float d = _cvtsh_ss(*(const uint16_t*)(w + 208));
    for (int r = 0; r < rows; r++) {
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]);
}

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

/* Q4_0, Q5_0 over GROUP weight rows at once. A block's levels for the 8 rows are unpacked and interleaved once
 * (kept in L1 for the tile's activation rows); each activation row's sums come out as one vector whose lanes are
 * the weight rows, so a block's float work (one conversion, one multiply-add) is shared by the 8 rows rather than
 * done for each, and w = d (q - mid) is taken off exactly in integers. */
AVX2 static INLINE void group_dot_q_0(const uint8_t* w, int64_t row_bytes, const ActRow* a, const int rows, int k,
                                      float* out, int64_t stride, const int five) {
  const int bytes = five ? 22 : 18, head = five ? 6 : 2, mid = five ? 16 : 8;
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_0; b++) {
    uint16_t scales[GROUP];
    __m256i q[GROUP], levels[4][2];
    for (int j = 0; j < GROUP; j++) {
      const uint8_t* p = w + j * row_bytes + b * bytes;
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

/* The same sums as dot_q6_k_rows for one activation row (a decode step), its levels held in registers as
 * dot_k4_each holds them. */
AVX2 static INLINE void dot_q6_k_each(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                      int64_t stride) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  __m256i pick[4]; /* part p of a half: its first 16's scale in the low lane, its second's in the high lane */
  for (int p = 0; p < 4; p++) pick[p] = broadcast16(2 * p, 2 * p + 1);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += 210) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192))); /* [16] int16 */
    __m256i levels[8], spread[8]; /* [half, part]: 32 levels; the scales of its two 16s */
    for (int half = 0; half < 2; half++) {
      const uint8_t *ql = w + 64 * half, *qhp = w + 128 + 32 * half;
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
      const __m256i h = _mm256_loadu_si256((const __m256i*)qhp);
      const __m256i half_scales = half ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                       : _mm256_permute2x128_si256(sc16, sc16, 0x00);
      __m256i* q = levels + 4 * half;
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
      for (int part = 0; part < 4; part++) spread[4 * half + part] = _mm256_shuffle_epi8(half_scales, pick[part]);
    }
    const float d = _cvtsh_ss(*(const uint16_t*)(w + 208));
#pragma GCC unroll 1 /* one row's sums at a time: the levels stay in registers */
    for (int r = 0; r < rows; r++) {
      const __m256i sums = _mm256_loadu_si256((const __m256i*)(a[r].sums + b * 16));
      __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
      for (int i = 0; i < 8; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a[r].q + b * QK_K + 32 * i));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(levels[i], x), spread[i]));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r].d[b]), _mm256_cvtepi32_ps(isum), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = hsum(acc[r]);
}

AVX2 static double int8_mac_rate_avx2(double seconds) {
  enum { K = 4096, ROWS = 4 };
  static _Thread_local int8_t x[ROWS * K]; /* 16 KB: stays in L1 */
  for (int i = 0; i < ROWS * K; i++) x[i] = (int8_t)(i * 37);
  const __m256i levels = _mm256_set1_epi8(11), scale = _mm256_set1_epi16(3);
  __m256i acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_si256();
  struct timespec start, now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
  double elapsed = 0.0, passes = 0.0;
  while (elapsed < seconds) {
    for (int pass = 0; pass < 64; pass++) {
      for (int i = 0; i < K; i += 64) {
        for (int r = 0; r < ROWS; r++) {
          const __m256i p0 = _mm256_maddubs_epi16(levels, _mm256_loadu_si256((const __m256i*)(x + r * K + i)));
          const __m256i p1 = _mm256_maddubs_epi16(levels, _mm256_loadu_si256((const __m256i*)(x + r * K + i + 32)));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(p0, scale), _mm256_madd_epi16(p1, scale)));
        }
      }
      __asm__ volatile("" ::: "memory"); /* each pass reads x again */
    }
    passes += 64;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
    elapsed = (double)(now.tv_sec - start.tv_sec) + 1e-9 * (double)(now.tv_nsec - start.tv_nsec);
  }
  __m256i total = acc[0];
  for (int r = 1; r < ROWS; r++) total = _mm256_add_epi32(total, acc[r]);
  volatile int sink = _mm256_extract_epi32(total, 0); /* the sums are used: the loop is not removed */
  (void)sink;
  return passes * ROWS * K / elapsed;
}

/* one function per type and tile height, so each loop over rows has a constant count */
#define TILED(name, call)                                                                                    \
  AVX2 static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) { \
    switch (rows) {                                                                                          \
      case 8: call(8); return;                                                                               \
      case 7: call(7); return;                                                                               \
      case 6: call(6); return;                                                                               \
      case 5: call(5); return;                                                                               \
      case 4: call(4); return;                                                                               \
      case 3: call(3); return;                                                                               \
      case 2: call(2); return;                                                                               \
      default: call(1); return;                                                                              \
    }                                                                                                        \
  }
#define GROUP_TILED(name, call)                                                                             \
  AVX2 static void name(const uint8_t* w, int64_t row_bytes, const ActRow* a, int rows, int k, float* out,   \
                        int64_t stride) {                                                                   \
    switch (rows) {                                                                                          \
      case 8: call(8); return;                                                                               \
      case 7: call(7); return;                                                                               \
      case 6: call(6); return;                                                                               \
      case 5: call(5); return;                                                                               \
      case 4: call(4); return;                                                                               \
      case 3: call(3); return;                                                                               \
      case 2: call(2); return;                                                                               \
      default: call(1); return;                                                                              \
    }                                                                                                        \
  }
#define Q4_0_CALL(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q4_0)
#define Q5_0_CALL(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q5_0)
#define Q4_1_CALL(n) dot_unsigned_rows(w, a, n, k, out, stride, GGML_Q4_1)
#define Q5_1_CALL(n) dot_unsigned_rows(w, a, n, k, out, stride, GGML_Q5_1)
#define Q8_0_CALL(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q8_0)
#define Q4_K_CALL(n) (n == 1 ? dot_k4_each(w, a, n, k, out, stride, 0) : dot_k4_rows(w, a, n, k, out, stride, 0))
#define Q5_K_CALL(n) (n == 1 ? dot_k4_each(w, a, n, k, out, stride, 1) : dot_k4_rows(w, a, n, k, out, stride, 1))
#define Q6_K_CALL(n) (n == 1 ? dot_q6_k_each(w, a, n, k, out, stride) : dot_q6_k_rows(w, a, n, k, out, stride))
TILED(dot_q4_0_avx2, Q4_0_CALL)
TILED(dot_q5_0_avx2, Q5_0_CALL)
TILED(dot_q8_0_avx2, Q8_0_CALL)
TILED(dot_q4_1_avx2, Q4_1_CALL)
TILED(dot_q5_1_avx2, Q5_1_CALL)
TILED(dot_q4_k_avx2, Q4_K_CALL)
TILED(dot_q5_k_avx2, Q5_K_CALL)
TILED(dot_q6_k_avx2, Q6_K_CALL)
#define Q4_0_GROUP(n) group_dot_q_0(w, row_bytes, a, n, k, out, stride, 0)
#define Q5_0_GROUP(n) group_dot_q_0(w, row_bytes, a, n, k, out, stride, 1)
GROUP_TILED(group_q4_0_avx2, Q4_0_GROUP)
GROUP_TILED(group_q5_0_avx2, Q5_0_GROUP)

/* The calling thread's int8 multiply-accumulate rate through the instructions every dot here is built from
 * (maddubs into int16 pairs, madd into int32, add), the activations read from L1 as the dots read them: the ceiling
 * the bench sets a prompt's achieved rate against. MACs per second of the thread's own CPU time (other processes
 * sharing the core do not lower it) over about `seconds` of it; 0 without AVX2. */
__attribute__((visibility("default"))) double staticlm_int8_mac_rate(double seconds) {
  if (!have_avx2()) return 0.0;
  return int8_mac_rate_avx2(seconds);
}

int have_avx2(void) {
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  return cached;
}

DotFn avx2_dot(int type) {
  switch (type) {
    case GGML_Q4_0: return dot_q4_0_avx2;
    case GGML_Q5_0: return dot_q5_0_avx2;
    case GGML_Q8_0: return dot_q8_0_avx2;
    case GGML_Q4_1: return dot_q4_1_avx2;
    case GGML_Q5_1: return dot_q5_1_avx2;
    case GGML_Q4_K: return dot_q4_k_avx2;
    case GGML_Q5_K: return dot_q5_k_avx2;
    case GGML_Q6_K: return dot_q6_k_avx2;
  }
  return NULL;
}
GroupDotFn avx2_group_dot(int type) {
  switch (type) {
    case GGML_Q4_0: return group_q4_0_avx2;
    case GGML_Q5_0: return group_q5_0_avx2;
  }
  return NULL;
}
#else
typedef int gguf_avx2_is_x86_only; /* an empty translation unit elsewhere */
#endif
