/* The AVX2 dots of one weight row with a tile of up to TILE activation rows: a weight block is unpacked once for
 * all of them. One activation row alone takes the K-quants' own passes (gguf_avx2_one.c). */
#if defined(__x86_64__) || defined(_M_X64)
#include "gguf_avx2_parts.h"

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

/* Q4_K / Q5_K: integer sums over a super-block with the 6-bit scales; the minima, as 8 floats per super-block and
 * weight row, dotted with each row's scaled sums in the same accumulator; one float multiply per super-block and row */
AVX2 static INLINE void dot_k4_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                    int64_t stride, const int five) {
  __m256i pick[8];
  for (int j = 0; j < 8; j++) pick[j] = broadcast16(j, j);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += K4_BLOCK_BYTES(five)) {
    __m256i scales, qh;
    __m256 minima;
    const uint8_t* qs = k4_header(w, five, &scales, &minima, &qh);
    __m256i isum[TILE];
    for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC keeps every row's products for one sum at the end, spilled */
    for (int c = 0; c < 4; c++) {
      __m256i lo, hi;
      k4_chunk(qs, qh, c, five, &lo, &hi);
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

AVX2 static INLINE void dot_q6_k_rows(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                      int64_t stride) {
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
      __m256i q[4];
      const __m256i half_scales = q6_half(w, half, sc16, q); /* this half's 8 scales in both lanes */
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

/* CALL_<type>(n): the type's dot of n activation rows, made one function by AVX2_BY_TYPE below */
#define CALL_q4_0(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q4_0)
#define CALL_q5_0(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q5_0)
#define CALL_q4_1(n) dot_unsigned_rows(w, a, n, k, out, stride, GGML_Q4_1)
#define CALL_q5_1(n) dot_unsigned_rows(w, a, n, k, out, stride, GGML_Q5_1)
#define CALL_q8_0(n) dot_signed_rows(w, a, n, k, out, stride, GGML_Q8_0)
#define CALL_q4_k(n) (n == 1 ? (void)(*out = dot_k4_one(w, a, k, 0)) : dot_k4_rows(w, a, n, k, out, stride, 0))
#define CALL_q5_k(n) (n == 1 ? (void)(*out = dot_k4_one(w, a, k, 1)) : dot_k4_rows(w, a, n, k, out, stride, 1))
#define CALL_q6_k(n) (n == 1 ? (void)(*out = dot_q6_k_one(w, a, k)) : dot_q6_k_rows(w, a, n, k, out, stride))

AVX2_BY_TYPE(ROW_DOT_TYPES, DotFn avx2_dot(int type))
#else
typedef int gguf_avx2_tile_is_x86_only; /* an empty translation unit elsewhere */
#endif
