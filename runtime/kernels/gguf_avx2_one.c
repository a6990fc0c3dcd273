/* The AVX2 K-quant dots for one activation row (a decode step): the same integer sums, in the same order, as the
 * tile's passes (gguf_avx2_tile.c), so a row's result does not depend on the rows beside it. */
#if defined(__x86_64__) || defined(_M_X64)
#include "gguf_avx2_parts.h"

/* The same sums as dot_k4_rows, in the same order, for one activation row (a decode step): a super-block's 8
 * sub-blocks of levels are unpacked at once and stay in registers, and the row's sums need one. Fewer instructions
 * than a tile's pass, but more loads per row: for two rows and more, the tile's pass is faster. */
AVX2 float dot_k4_one(const uint8_t* w, const ActRow* a, int k, int five) {
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += K4_BLOCK_BYTES(five)) {
    __m256i scales, qh, levels[8], spread[8]; /* [sub-block]: 32 levels; its scale in every int16 */
    __m256 minima;
    const uint8_t* qs = k4_header(w, five, &scales, &minima, &qh);
    for (int c = 0; c < 4; c++) k4_chunk(qs, qh, c, five, &levels[2 * c], &levels[2 * c + 1]);
    for (int s = 0; s < 8; s++) spread[s] = _mm256_shuffle_epi8(scales, broadcast16(s, s));
    const float d = _cvtsh_ss(*(const uint16_t*)w);
    const int8_t* x = a->q + b * QK_K;
    __m256i isum = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
      const __m256i p = _mm256_maddubs_epi16(levels[s], _mm256_loadu_si256((const __m256i*)(x + 32 * s)));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, spread[s]));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d[b]), _mm256_cvtepi32_ps(isum), acc);
    acc = _mm256_fnmadd_ps(minima, _mm256_loadu_ps(a->scaled + b * 8), acc);
  }
  return hsum(acc);
}

/* The same sums as dot_q6_k_rows for one activation row (a decode step), its levels held in registers as
 * dot_k4_one holds them. */
AVX2 float dot_q6_k_one(const uint8_t* w, const ActRow* a, int k) {
  __m256i pick[4]; /* part p of a half: its first 16's scale in the low lane, its second's in the high lane */
  for (int p = 0; p < 4; p++) pick[p] = broadcast16(2 * p, 2 * p + 1);
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += 210) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192))); /* [16] int16 */
    __m256i levels[8], spread[8]; /* [half, part]: 32 levels; the scales of its two 16s */
    for (int half = 0; half < 2; half++) {
      const __m256i half_scales = q6_half(w, half, sc16, levels + 4 * half);
      for (int part = 0; part < 4; part++) spread[4 * half + part] = _mm256_shuffle_epi8(half_scales, pick[part]);
    }
    const float d = _cvtsh_ss(*(const uint16_t*)(w + 208));
    const __m256i sums = _mm256_loadu_si256((const __m256i*)(a->sums + b * 16));
    __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
    for (int i = 0; i < 8; i++) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(a->q + b * QK_K + 32 * i));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(levels[i], x), spread[i]));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d[b]), _mm256_cvtepi32_ps(isum), acc);
  }
  return hsum(acc);
}
#else
typedef int gguf_avx2_one_is_x86_only; /* an empty translation unit elsewhere */
#endif
