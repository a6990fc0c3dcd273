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

/* x's 32 levels as 4 eighths, each 8 levels repeated over a vector (one per 4 rows' 8 levels it multiplies) */
AVX2 static INLINE void broadcast_eighths(const int8_t* x, __m256i out[4]) {
  for (int e = 0; e < 4; e++) {
    int64_t eighth;
    memcpy(&eighth, x + 8 * e, 8);
    out[e] = _mm256_set1_epi64x(eighth);
  }
}

/* x's 32 levels against a group block's sub-block of 8 rows (levels [eighth][half], as interleave_eighths leaves them):
 * per half, the int16 products of its first 16 inputs (eighths 0, 1) and of its second 16 (eighths 2, 3) */
AVX2 static INLINE void sixteens(__m256i levels[4][2], const int8_t* x, __m256i first[2], __m256i second[2]) {
  __m256i eighths[4];
  broadcast_eighths(x, eighths);
  for (int h = 0; h < 2; h++) {
    first[h] = _mm256_add_epi16(_mm256_maddubs_epi16(levels[0][h], eighths[0]),
                                _mm256_maddubs_epi16(levels[1][h], eighths[1]));
    second[h] = _mm256_add_epi16(_mm256_maddubs_epi16(levels[2][h], eighths[2]),
                                 _mm256_maddubs_epi16(levels[3][h], eighths[3]));
  }
}

/* x's 32 levels dotted with 8 weight rows' interleaved levels: [8] int32, one lane per row. Each eighth of x is
 * broadcast against 4 rows' eighths; the products stay in int16 over the 4 eighths (8 products of at most 31 x 127
 * per lane), then int32. */
AVX2 static INLINE __m256i dot_eighths(__m256i levels[4][2], const int8_t* x) {
  __m256i half_sums[2], first[2], second[2];
  sixteens(levels, x, first, second);
  for (int half = 0; half < 2; half++) {
    half_sums[half] = _mm256_madd_epi16(_mm256_add_epi16(first[half], second[half]), _mm256_set1_epi16(1));
  }
  return _mm256_hadd_epi32(half_sums[0], half_sums[1]);
}

/* One activation row x (a super-block's 256 levels) against a K-quant group block's 8 sub-blocks of 32 for 8 rows
 * (levels [sub-block][eighth][half]): [8] int32, a lane per weight row. spread: the rows' scales by half, one per
 * sub-block ([8][2], Q4_K: its two 16s' int16 products add before the scale) or, per_sixteen, one per 16 inputs
 * ([16][2], Q6_K, whose products would overflow int16 over 32). */
AVX2 static INLINE __m256i group_row_sums(__m256i levels[8][4][2], __m256i spread[][2], const int8_t* x,
                                          const int per_sixteen) {
  __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int s = 0; s < 8; s++) {
    __m256i first[2], second[2];
    sixteens(levels[s], x + 32 * s, first, second);
    for (int h = 0; h < 2; h++) {
      const __m256i sum = per_sixteen ? _mm256_add_epi32(_mm256_madd_epi16(first[h], spread[2 * s][h]),
                                                         _mm256_madd_epi16(second[h], spread[2 * s + 1][h]))
                                      : _mm256_madd_epi16(_mm256_add_epi16(first[h], second[h]), spread[s][h]);
      isum[h] = _mm256_add_epi32(isum[h], sum);
    }
  }
  return _mm256_hadd_epi32(isum[0], isum[1]);
}

/* Q4_0, Q5_0, Q4_1, Q5_1 over a group (block_q4_0x8 and its kin: a block's 8 rows side by side). A block's levels for the 8 rows are unpacked and interleaved once (kept in L1
 * for the tile's activation rows); each activation row's sums come out as one vector whose lanes are the weight
 * rows, so a block's float work (one conversion, one multiply-add) is shared by the 8 rows rather than done for
 * each. w = d (q - mid) is taken off exactly in integers; w = d q + m (minimum) adds m times the row's scaled sum. */
AVX2 static INLINE void group_dot_32(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                     int64_t stride, const int five, const int minimum) {
  const int head = 2 + 2 * minimum + 4 * five, bytes = head + 16, mid = minimum ? 0 : five ? 16 : 8;
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_0; b++) {
    uint16_t scales[GROUP], minima[GROUP];
    __m256i q[GROUP], levels[4][2];
    for (int j = 0; j < GROUP; j++) {
      const uint8_t* p = w + (b * GROUP + j) * bytes;
      memcpy(&scales[j], p, 2);
      if (minimum) memcpy(&minima[j], p + 2, 2);
      q[j] = nibbles32(p + head);
      if (five) {
        uint32_t qh;
        memcpy(&qh, p + head - 4, 4);
        q[j] = _mm256_or_si256(q[j], _mm256_and_si256(bit_bytes(qh), sixteen));
      }
    }
    interleave_eighths(q, levels);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)scales));
    const __m256 m = minimum ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)minima)) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
      __m256i sums = dot_eighths(levels, a[r].q + b * 32); /* [8] rows' q . x */
      if (!minimum) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(mid * (a[r].sums[2 * b] + a[r].sums[2 * b + 1])));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(a[r].d[b])), acc[r]);
      if (minimum) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a[r].scaled[b]), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * stride, acc[r]);
}

/* pshufb mask: int16 lanes 0..3 of each 128-bit lane take byte 4 (2 h) + s of that lane's dwords, lanes 4..7 byte
 * 4 (2 h + 1) + s: from 8 rows' 4 scale bytes (dword j % 4 of lane j / 4), rows 2h, 2h+1 | 2h+4, 2h+5 as int16 */
AVX2 static INLINE __m256i scale_pick(int h, int s) {
  const short first = (short)(0x8000 | (8 * h + s)), second = (short)(0x8000 | (8 * h + 4 + s));
  const __m128i lane = _mm_setr_epi16(first, first, first, first, second, second, second, second);
  return _mm256_set_m128i(lane, lane);
}

/* bytes b, b + 1 of each dword -> int16 pair (zero-extended) */
AVX2 static INLINE __m256i byte_pair(__m256i v, int b) {
  const __m256i low = _mm256_set1_epi32(0xff), high = _mm256_set1_epi32(0xff0000);
  const __m256i shifted = _mm256_srli_epi32(v, 8 * b);
  return _mm256_or_si256(_mm256_and_si256(shifted, low), _mm256_and_si256(_mm256_slli_epi32(shifted, 8), high));
}

/* Q4_K over a group block (block_q4_Kx8): the 8 rows' 6-bit scales are unpacked in one pass of vector words, the
 * levels need only a mask and a shift (the exporter placed them), and each activation row's sums for the 8 rows
 * come out as one vector: sub-block products in int16 over 4 eighths (at most 8 x 15 x 127 per lane), times each
 * row's scale into int32; the minima's sum m . (x's sub-block sums) in integers too, as the portable dot does. */
AVX2 static INLINE void group_dot_q4_k(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                       int64_t stride) {
  const __m256i m4 = _mm256_set1_epi8(15), low6 = _mm256_set1_epi32(0x3f3f3f3f);
  const __m256i low4 = _mm256_set1_epi32(0x0f0f0f0f), low2 = _mm256_set1_epi32(0x03030303);
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += K4_GROUP_BYTES) {
    const block_q4_Kx8* g = (const block_q4_Kx8*)w;
    const __m256i u0 = _mm256_loadu_si256((const __m256i*)g->scale_words[0]);
    const __m256i u1 = _mm256_loadu_si256((const __m256i*)g->scale_words[1]);
    const __m256i u2 = _mm256_loadu_si256((const __m256i*)g->scale_words[2]); /* [8] rows' words (k4_scales) */
    const __m256i scales[2] = {
        _mm256_and_si256(u0, low6),
        _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), low2), 4))};
    const __m256i minima_lo = _mm256_and_si256(u1, low6);
    const __m256i minima_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
                                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), low2), 4));
    const __m256i minima[4] = {byte_pair(minima_lo, 0), byte_pair(minima_lo, 2), byte_pair(minima_hi, 0),
                               byte_pair(minima_hi, 2)}; /* [8] rows: (m 2p, m 2p + 1) as int16 */
    __m256i levels[8][4][2], spread[8][2]; /* [sub-block][eighth][half]: 32 levels of 4 rows; the rows' scales */
    for (int c = 0; c < 4; c++) {
      for (int v = 0; v < 8; v++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)g->qs[c][v / 2][v % 2]);
        levels[2 * c][v / 2][v % 2] = _mm256_and_si256(raw, m4);
        levels[2 * c + 1][v / 2][v % 2] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      }
    }
    for (int s = 0; s < 8; s++) {
      for (int h = 0; h < 2; h++) spread[s][h] = _mm256_shuffle_epi8(scales[s / 4], scale_pick(h, s % 4));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g->d));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g->dmin));
    for (int r = 0; r < rows; r++) {
      const __m256i isum = group_row_sums(levels, spread, a[r].q + b * QK_K, 0);
      /* x's 8 sub-block sums as int16 (S0..S3 | S4..S7 in each lane's low half), taken two at a time */
      const __m256i pairs = _mm256_hadd_epi16(_mm256_loadu_si256((const __m256i*)(a[r].sums + b * 16)),
                                              _mm256_setzero_si256());
      __m256i msum = _mm256_setzero_si256();
      for (int p = 0; p < 4; p++) {
        const __m256i xp = _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(p / 2 * 4 + p % 2));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(minima[p], xp));
      }
      const __m256 ad = _mm256_set1_ps(a[r].d[b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, ad), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * stride, acc[r]);
}

/* pshufb mask over 8 rows' int16 values (rows 0..7 in each 128-bit lane): int16 lanes 0..3 of the low lane take
 * row 2h, lanes 4..7 row 2h + 1; in the high lane rows 2h + 4 and 2h + 5 */
AVX2 static INLINE __m256i row_pick16(int h) {
  const short first = (short)(4 * h | (4 * h + 1) << 8), second = (short)((4 * h + 2) | (4 * h + 3) << 8);
  const short fifth = (short)((4 * h + 8) | (4 * h + 9) << 8), sixth = (short)((4 * h + 10) | (4 * h + 11) << 8);
  return _mm256_set_m128i(_mm_setr_epi16(fifth, fifth, fifth, fifth, sixth, sixth, sixth, sixth),
                          _mm_setr_epi16(first, first, first, first, second, second, second, second));
}

/* Q6_K over a group block (block_q6_Kx8): the 8 rows' 6-bit levels need masks and shifts only, each 16 inputs' products
 * stay in int16 over 2 eighths (at most 4 x 63 x 127 per lane) before the rows' scales, and the levels' offset 32 is
 * taken off once per super-block as -32 sc . (x's sums of 16), as the portable dot does. */
AVX2 static INLINE void group_dot_q6_k(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                       int64_t stride) {
  const __m256i pick[2] = {row_pick16(0), row_pick16(1)};
  __m256 acc[TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / QK_K; b++, w += Q6_GROUP_BYTES) {
    const block_q6_Kx8* g = (const block_q6_Kx8*)w;
    __m256i levels[8][4][2], spread[16][2], pairs[8]; /* [sub-block of 32][eighth][half]; [16s][half]; [8] rows */
    for (int s = 0; s < 16; s++) { /* the 8 rows' scale s as int16, in both lanes, then spread over the halves */
      const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)g->scales[s])));
      for (int h = 0; h < 2; h++) spread[s][h] = _mm256_shuffle_epi8(sc, pick[h]);
    }
    for (int p = 0; p < 8; p++) { /* [8] rows: (scale 2p, scale 2p + 1) as int16 */
      const __m128i v = _mm_loadu_si128((const __m128i*)g->scales[2 * p]);
      pairs[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
    }
    for (int t = 0; t < 2; t++) {
      for (int v = 0; v < 8; v++) {
        __m256i q[4];
        q6_levels(_mm256_loadu_si256((const __m256i*)g->levels[t][0][v / 2][v % 2]),
                  _mm256_loadu_si256((const __m256i*)g->levels[t][1][v / 2][v % 2]),
                  _mm256_loadu_si256((const __m256i*)g->levels[t][2][v / 2][v % 2]), q);
        for (int i = 0; i < 4; i++) levels[4 * t + i][v / 2][v % 2] = q[i];
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g->d));
    for (int r = 0; r < rows; r++) {
      const __m256i isum = group_row_sums(levels, spread, a[r].q + b * QK_K, 1);
      __m256i offset = _mm256_setzero_si256();
      for (int p = 0; p < 8; p++) {
        int32_t sums;
        memcpy(&sums, a[r].sums + b * 16 + 2 * p, 4);
        offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pairs[p], _mm256_set1_epi32(sums)));
      }
      const __m256i total = _mm256_sub_epi32(isum, _mm256_slli_epi32(offset, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(a[r].d[b])), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * stride, acc[r]);
}

/* CALL_<type>(n): the type's group dot of n activation rows, made one function by AVX2_BY_TYPE below */
#define CALL_q4_0(n) group_dot_32(w, a, n, k, out, stride, 0, 0)
#define CALL_q5_0(n) group_dot_32(w, a, n, k, out, stride, 1, 0)
#define CALL_q4_1(n) group_dot_32(w, a, n, k, out, stride, 0, 1)
#define CALL_q5_1(n) group_dot_32(w, a, n, k, out, stride, 1, 1)
#define CALL_q4_k(n) group_dot_q4_k(w, a, n, k, out, stride)
#define CALL_q6_k(n) group_dot_q6_k(w, a, n, k, out, stride)

AVX2_BY_TYPE(GROUP_DOT_TYPES, GroupDotFn avx2_group_dot(int type))
#else
typedef int gguf_avx2_group_is_x86_only; /* an empty translation unit elsewhere */
#endif
