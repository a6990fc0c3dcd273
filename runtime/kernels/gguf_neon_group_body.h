/* The ARM64 group dots at one level: gguf_neon_group.c includes this once with the dot-product instruction (USE_MMLA
 * 0) and once with i8mm's matrix multiply (USE_MMLA 1); LEVEL_ATTR is that level's target attribute and
 * NAME(x) names x at that level. Everything else is shared: only the products of a pair of weight rows with the
 * tile's activation rows (pair_dots) differ, and they give the same integers. */

/* P[r] = the 8 rows' dots with tile row r's inputs offset .. offset + 8 n (L's first n eighths), in the pairs'
 * order: [rows 0, 1, 4, 5], [rows 2, 3, 6, 7]. */
LEVEL_ATTR static NEON_INLINE void NAME(pair_dots)(int8x16_t (*L)[4], const int n, const ActRow* a,
                                                   const int rows, int offset, int32x4_t P[TILE][2]) {
#if !USE_MMLA
  /* sdot: a pair's 16 bytes (8 inputs of 2 rows) times the 8 inputs twice -> 4 lanes, 2 per row */
  for (int r = 0; r < rows; r++) {
    const int8_t* x = a[r].q + offset;
    int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int e = 0; e < n; e++) {
      const int8x16_t both = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t*)(x + 8 * e))); /* 8 inputs, twice */
      for (int p = 0; p < 4; p++) acc[p] = vdotq_s32(acc[p], L[e][p], both);
    }
    P[r][0] = vpaddq_s32(acc[0], acc[1]);
    P[r][1] = vpaddq_s32(acc[2], acc[3]);
  }
#else
  /* smmla: a pair's 2 x 8 levels times 2 activation rows' 8 inputs -> [row A . x0, row A . x1, row B . x0, row B . x1],
   * 32 products in one instruction; an odd tile's last row goes with itself */
  for (int r = 0; r < rows; r += 2) {
    const int8_t *x0 = a[r].q + offset, *x1 = a[r + 1 < rows ? r + 1 : r].q + offset;
    int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int e = 0; e < n; e++) {
      const int8x16_t both = vcombine_s8(vld1_s8(x0 + 8 * e), vld1_s8(x1 + 8 * e));
      for (int p = 0; p < 4; p++) acc[p] = vmmlaq_s32(acc[p], L[e][p], both);
    }
    P[r][0] = vuzp1q_s32(acc[0], acc[1]);
    P[r][1] = vuzp1q_s32(acc[2], acc[3]);
    if (r + 1 < rows) {
      P[r + 1][0] = vuzp2q_s32(acc[0], acc[1]);
      P[r + 1][1] = vuzp2q_s32(acc[2], acc[3]);
    }
  }
#endif
}

/* Q4_0, Q5_0, Q4_1, Q5_1 over a group (block_q4_0x8 and its kin): per block, each tile row's sums for the 8 rows
 * as two vectors, then each row's float expression of the portable dot, lane by lane. */
LEVEL_ATTR static NEON_INLINE void NAME(group_dot_32)(const uint8_t* w, const ActRow* a, const int rows, int k,
                                                  float* out, int64_t stride, const int type) {
  const Block32 f = block32(type);
  float32x4_t total[TILE][2];
  for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = vdupq_n_f32(0.0f);
  for (int b = 0; b < k / QK_0; b++, w += GROUP * f.bytes) {
    float32x4_t d[2], m[2];
    group_scales32(w, f, d, m);
    int32x4_t P[TILE][2];
    if (rows == 1) { /* a decode step: each row's 32 levels against the 32 inputs, the rows' sums in their order */
      const int8x16_t x0 = vld1q_s8(a[0].q + b * QK_0), x1 = vld1q_s8(a[0].q + b * QK_0 + 16);
      int32x4_t acc[GROUP];
      for (int j = 0; j < GROUP; j++) {
        int8x16_t lo, hi;
        levels32_neon(w + j * f.bytes, type, &lo, &hi);
        acc[j] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, x0), hi, x1);
      }
      P[0][0] = sums4(acc[0], acc[1], acc[4], acc[5]); /* the pairs' order, as pair_dots gives them */
      P[0][1] = sums4(acc[2], acc[3], acc[6], acc[7]);
    } else {
      int8x16_t L[4][4];
      group_levels32(w, type, L);
      NAME(pair_dots)(L, 4, a, rows, b * QK_0, P);
    }
    for (int r = 0; r < rows; r++) {
      int32x4_t sums[2];
      swap_pairs(P[r][0], P[r][1], sums);
      const float level_sum = (float)(a[r].sums[2 * b] + a[r].sums[2 * b + 1]);
      for (int h = 0; h < 2; h++) {
        float32x4_t t = vmulq_f32(d[h], vcvtq_f32_s32(sums[h]));
        if (f.minimum) t = vaddq_f32(t, vmulq_n_f32(m[h], level_sum));
        total[r][h] = vaddq_f32(total[r][h], vmulq_n_f32(t, a[r].d[b]));
      }
    }
  }
  for (int r = 0; r < rows; r++) vst1q_f32(out + r * stride, total[r][0]), vst1q_f32(out + r * stride + 4, total[r][1]);
}

/* Q4_K over a group block with one activation row (a decode step): each level vector multiplied as it is unpacked */
LEVEL_ATTR static NEON_INLINE void NAME(q4_k_group_one)(const block_q4_Kx8* g, const int8_t* x_block,
                                                        uint32x4_t scales[2][2], int32x4_t isum[2]) {
  const uint8x16_t m4 = vdupq_n_u8(BROKEN(GGML_Q4_K) ? 14 : 15);
  for (int s = 0; s < 8; s++) {
    const int8_t* x = x_block + 32 * s;
    int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int e = 0; e < 4; e++) {
      const int8x16_t both = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t*)(x + 8 * e)));
      for (int p = 0; p < 4; p++) {
        const uint8x16_t raw = vld1q_u8(g->qs[s / 2][e][p / 2][2 * (p % 2)]);
        acc[p] = vdotq_s32(acc[p], vreinterpretq_s8_u8(s % 2 ? vshrq_n_u8(raw, 4) : vandq_u8(raw, m4)), both);
      }
    }
    isum[0] = vmlaq_s32(isum[0], vpaddq_s32(acc[0], acc[1]), lane_byte(scales[s / 4][0], s % 4));
    isum[1] = vmlaq_s32(isum[1], vpaddq_s32(acc[2], acc[3]), lane_byte(scales[s / 4][1], s % 4));
  }
}

/* Q4_K over a group block (block_q4_Kx8): per sub-block, the rows' levels by a mask or a shift (the exporter placed
 * them), each tile row's 8 sums weighted by the rows' scales in integers; the minima dotted with the row's sub-block
 * sums in integers; then the portable dot's float expression, lane by lane. */
LEVEL_ATTR static NEON_INLINE void NAME(group_dot_q4_k)(const uint8_t* w, const ActRow* a, const int rows, int k,
                                                        float* out, int64_t stride) {
  const uint8x16_t m4 = vdupq_n_u8(BROKEN(GGML_Q4_K) ? 14 : 15);
  float32x4_t total[TILE][2];
  for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = vdupq_n_f32(0.0f);
  for (int b = 0; b < k / QK_K; b++, w += K4_GROUP_BYTES) {
    const block_q4_Kx8* g = (const block_q4_Kx8*)w;
    uint32x4_t scales[2][2]; /* [sub-blocks 0..3 | 4..7][pairs' order A | B]: a row's 4 scales per lane */
    int16x8_t minima[8];     /* [sub-block]: the 8 rows' minima */
    k4_group_scales(g, scales, minima);
    int32x4_t isum[TILE][2];
    for (int r = 0; r < rows; r++) isum[r][0] = isum[r][1] = vdupq_n_s32(0);
    if (rows == 1) NAME(q4_k_group_one)(g, a[0].q + b * QK_K, scales, isum[0]);
    for (int s = 0; rows > 1 && s < 8; s++) {
      int8x16_t L[4][4];
      for (int e = 0; e < 4; e++) {
        for (int p = 0; p < 4; p++) {
          const uint8x16_t raw = vld1q_u8(g->qs[s / 2][e][p / 2][2 * (p % 2)]);
          L[e][p] = vreinterpretq_s8_u8(s % 2 ? vshrq_n_u8(raw, 4) : vandq_u8(raw, m4));
        }
      }
      const int32x4_t scale_a = lane_byte(scales[s / 4][0], s % 4), scale_b = lane_byte(scales[s / 4][1], s % 4);
      int32x4_t P[TILE][2];
      NAME(pair_dots)(L, 4, a, rows, b * QK_K + 32 * s, P);
      for (int r = 0; r < rows; r++) {
        isum[r][0] = vmlaq_s32(isum[r][0], P[r][0], scale_a);
        isum[r][1] = vmlaq_s32(isum[r][1], P[r][1], scale_b);
      }
    }
    const float32x4_t d[2] = {fp16x4(g->d[0]), fp16x4(g->d[4])}, dmin[2] = {fp16x4(g->dmin[0]), fp16x4(g->dmin[4])};
    for (int r = 0; r < rows; r++) {
      int32x4_t sums[2], msum[2];
      swap_pairs(isum[r][0], isum[r][1], sums);
      k4_group_minima(minima, a[r].sums + 16 * b, msum);
      for (int h = 0; h < 2; h++) {
        const float32x4_t t = vsubq_f32(vmulq_f32(d[h], vcvtq_f32_s32(sums[h])),
                                        vmulq_f32(dmin[h], vcvtq_f32_s32(msum[h])));
        total[r][h] = vaddq_f32(total[r][h], vmulq_n_f32(t, a[r].d[b]));
      }
    }
  }
  for (int r = 0; r < rows; r++) vst1q_f32(out + r * stride, total[r][0]), vst1q_f32(out + r * stride + 4, total[r][1]);
}

/* Q6_K over a group block with one activation row (a decode step): per half t and 16s 2 q + v, each level vector
 * multiplied as it is unpacked, its 3 loads serving the 4 parts */
LEVEL_ATTR static NEON_INLINE void NAME(q6_k_group_one)(const block_q6_Kx8* g, const int8_t* x_block,
                                                        int32x4_t isum[2]) {
  for (int tv = 0; tv < 4; tv++) {
    const int t = tv / 2, v = tv % 2;
    const int8_t* x = x_block + 128 * t;
    int32x4_t acc[4][4]; /* [part q][pair] */
    for (int q = 0; q < 4; q++) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = vdupq_n_s32(0);
    for (int e = 2 * v; e < 2 * v + 2; e++) {
      int8x16_t both[4];
      for (int q = 0; q < 4; q++) both[q] = vreinterpretq_s8_s64(vld1q_dup_s64((const int64_t*)(x + 32 * q + 8 * e)));
      for (int p = 0; p < 4; p++) {
        const int h = p / 2, i = 2 * (p % 2);
        const uint8x16_t ql0 = vld1q_u8(g->levels[t][0][e][h][i]), ql1 = vld1q_u8(g->levels[t][1][e][h][i]);
        const uint8x16_t qh = vld1q_u8(g->levels[t][2][e][h][i]);
        for (int q = 0; q < 4; q++) acc[q][p] = vdotq_s32(acc[q][p], q6_part(ql0, ql1, qh, q), both[q]);
      }
    }
    for (int q = 0; q < 4; q++) {
      int32x4_t scale[2];
      q6_group_scale(g, 8 * t + 2 * q + v, scale);
      isum[0] = vmlaq_s32(isum[0], vpaddq_s32(acc[q][0], acc[q][1]), scale[0]);
      isum[1] = vmlaq_s32(isum[1], vpaddq_s32(acc[q][2], acc[q][3]), scale[1]);
    }
  }
}

/* Q6_K over a group block (block_q6_Kx8): per 32 inputs of a half, the rows' levels by masks and shifts, minus 32;
 * each 16's sums weighted by the rows' int8 scales in integers; then the portable dot's float expression. */
LEVEL_ATTR static NEON_INLINE void NAME(group_dot_q6_k)(const uint8_t* w, const ActRow* a, const int rows, int k,
                                                    float* out, int64_t stride) {
  float32x4_t total[TILE][2];
  for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = vdupq_n_f32(0.0f);
  for (int b = 0; b < k / QK_K; b++, w += Q6_GROUP_BYTES) {
    const block_q6_Kx8* g = (const block_q6_Kx8*)w;
    int32x4_t isum[TILE][2];
    for (int r = 0; r < rows; r++) isum[r][0] = isum[r][1] = vdupq_n_s32(0);
    if (rows == 1) NAME(q6_k_group_one)(g, a[0].q + b * QK_K, isum[0]);
    for (int u = 0; rows > 1 && u < 8; u++) { /* inputs 32 u ..: half u / 4, part u % 4 */
      const int t = u / 4, q = u % 4;
      int8x16_t L[4][4];
      for (int e = 0; e < 4; e++) {
        for (int p = 0; p < 4; p++) {
          const int h = p / 2, i = 2 * (p % 2);
          L[e][p] = q6_part(vld1q_u8(g->levels[t][0][e][h][i]), vld1q_u8(g->levels[t][1][e][h][i]),
                            vld1q_u8(g->levels[t][2][e][h][i]), q);
        }
      }
      for (int v = 0; v < 2; v++) { /* the 16s: eighths 2 v, 2 v + 1 */
        int32x4_t scale[2], P[TILE][2];
        q6_group_scale(g, 2 * u + v, scale);
        NAME(pair_dots)(L + 2 * v, 2, a, rows, b * QK_K + 32 * u + 16 * v, P);
        for (int r = 0; r < rows; r++) {
          isum[r][0] = vmlaq_s32(isum[r][0], P[r][0], scale[0]);
          isum[r][1] = vmlaq_s32(isum[r][1], P[r][1], scale[1]);
        }
      }
    }
    const float32x4_t d[2] = {fp16x4(g->d[0]), fp16x4(g->d[4])};
    for (int r = 0; r < rows; r++) {
      int32x4_t sums[2];
      swap_pairs(isum[r][0], isum[r][1], sums);
      for (int h = 0; h < 2; h++) {
        total[r][h] = vaddq_f32(total[r][h], vmulq_f32(vmulq_n_f32(d[h], a[r].d[b]), vcvtq_f32_s32(sums[h])));
      }
    }
  }
  for (int r = 0; r < rows; r++) vst1q_f32(out + r * stride, total[r][0]), vst1q_f32(out + r * stride + 4, total[r][1]);
}

#define GROUP_TILED(name, call)                                                                                \
  LEVEL_ATTR static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) { \
    BY_COUNT(rows, call)                                                                                        \
  }
#define Q4_0_GROUP(n) NAME(group_dot_32)(w, a, n, k, out, stride, GGML_Q4_0)
#define Q5_0_GROUP(n) NAME(group_dot_32)(w, a, n, k, out, stride, GGML_Q5_0)
#define Q4_1_GROUP(n) NAME(group_dot_32)(w, a, n, k, out, stride, GGML_Q4_1)
#define Q5_1_GROUP(n) NAME(group_dot_32)(w, a, n, k, out, stride, GGML_Q5_1)
#define Q4_K_GROUP(n) NAME(group_dot_q4_k)(w, a, n, k, out, stride)
#define Q6_K_GROUP(n) NAME(group_dot_q6_k)(w, a, n, k, out, stride)
GROUP_TILED(NAME(group_q4_0), Q4_0_GROUP)
GROUP_TILED(NAME(group_q5_0), Q5_0_GROUP)
GROUP_TILED(NAME(group_q4_1), Q4_1_GROUP)
GROUP_TILED(NAME(group_q5_1), Q5_1_GROUP)
GROUP_TILED(NAME(group_q4_k), Q4_K_GROUP)
GROUP_TILED(NAME(group_q6_k), Q6_K_GROUP)
#undef GROUP_TILED
#undef Q4_0_GROUP
#undef Q5_0_GROUP
#undef Q4_1_GROUP
#undef Q5_1_GROUP
#undef Q4_K_GROUP
#undef Q6_K_GROUP
