/* The ARM64 dots of a group of GROUP weight rows stored as one stream (gguf_dot.h's group blocks) with a tile of
 * activation rows. The 8 rows' levels of 8 inputs are 4 pairs of rows, 16 bytes each (EighthOf8Rows): one sdot
 * multiplies a pair by one activation row's 8 inputs, one smmla (i8mm) by two activation rows' at once. A block's
 * levels, scales and float work serve the 8 rows together; each row's integer sums are the portable dot's, then its
 * float expression in the portable order (gguf_neon.h). */
#if defined(__aarch64__) || defined(_M_ARM64)
#include "gguf_neon_parts.h"

static const int pair_rows[4][2] = K4_PAIR_ROWS;

/* a 32-input block b of the 8 rows (block_q4_0x8 and its kin) as [eighth][pair] */
static NEON_INLINE void group_levels32(const uint8_t* w, int type, int8x16_t L[4][4]) {
  const int bytes = block32(type).bytes;
  int64x2_t lo[GROUP], hi[GROUP];
  for (int j = 0; j < GROUP; j++) {
    int8x16_t l, h;
    levels32_neon(w + j * bytes, type, &l, &h);
    lo[j] = vreinterpretq_s64_s8(l), hi[j] = vreinterpretq_s64_s8(h);
  }
  for (int p = 0; p < 4; p++) {
    const int ra = pair_rows[p][0], rb = pair_rows[p][1];
    L[0][p] = vreinterpretq_s8_s64(vzip1q_s64(lo[ra], lo[rb]));
    L[1][p] = vreinterpretq_s8_s64(vzip2q_s64(lo[ra], lo[rb]));
    L[2][p] = vreinterpretq_s8_s64(vzip1q_s64(hi[ra], hi[rb]));
    L[3][p] = vreinterpretq_s8_s64(vzip2q_s64(hi[ra], hi[rb]));
  }
}

/* the 8 rows' d and (types with a minimum) m of a 32-input block b: rows 0..3, 4..7 */
static NEON_INLINE void group_scales32(const uint8_t* w, Block32 f, float32x4_t d[2], float32x4_t m[2]) {
  uint8_t ds[GROUP][2], ms[GROUP][2] = {{0}};
  for (int j = 0; j < GROUP; j++) {
    memcpy(ds[j], w + j * f.bytes, 2);
    if (f.minimum) memcpy(ms[j], w + j * f.bytes + 2, 2);
  }
  d[0] = fp16x4(ds[0]), d[1] = fp16x4(ds[4]);
  m[0] = fp16x4(ms[0]), m[1] = fp16x4(ms[4]);
}

/* a Q4_K group block's 8 rows' scales (k4_scales: a row per 32-bit lane, sub-block s in byte s % 4) in the pairs'
 * order, and its minima as [sub-block][row] */
static NEON_INLINE void k4_group_scales(const block_q4_Kx8* g, uint32x4_t scales[2][2], int16x8_t minima[8]) {
  const uint32x4_t low6 = vdupq_n_u32(0x3f3f3f3f), low4 = vdupq_n_u32(0x0f0f0f0f), low2 = vdupq_n_u32(0x03030303);
  static const uint8_t pick[2][16] = {{0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29},
                                      {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31}};
  uint32x4_t sc[2][2], mn[2][2]; /* [sub-blocks 0..3 | 4..7][rows 0..3 | 4..7] */
  for (int h = 0; h < 2; h++) {
    const uint32x4_t u0 = vreinterpretq_u32_u8(vld1q_u8(g->scale_words[0][4 * h]));
    const uint32x4_t u1 = vreinterpretq_u32_u8(vld1q_u8(g->scale_words[1][4 * h]));
    const uint32x4_t u2 = vreinterpretq_u32_u8(vld1q_u8(g->scale_words[2][4 * h]));
    sc[0][h] = vandq_u32(u0, low6);
    sc[1][h] = vorrq_u32(vandq_u32(u2, low4), vshlq_n_u32(vandq_u32(vshrq_n_u32(u0, 6), low2), 4));
    mn[0][h] = vandq_u32(u1, low6);
    mn[1][h] = vorrq_u32(vandq_u32(vshrq_n_u32(u2, 4), low4), vshlq_n_u32(vandq_u32(vshrq_n_u32(u1, 6), low2), 4));
  }
  for (int i = 0; i < 2; i++) {
    int32x4_t pairs[2];
    swap_pairs(vreinterpretq_s32_u32(sc[i][0]), vreinterpretq_s32_u32(sc[i][1]), pairs);
    scales[i][0] = vreinterpretq_u32_s32(pairs[0]), scales[i][1] = vreinterpretq_u32_s32(pairs[1]);
    const uint8x16x2_t table = {{vreinterpretq_u8_u32(mn[i][0]), vreinterpretq_u8_u32(mn[i][1])}};
    for (int t = 0; t < 2; t++) { /* minima 4 i + 2 t and 4 i + 2 t + 1 of the 8 rows */
      const uint8x16_t two = vqtbl2q_u8(table, vld1q_u8(pick[t]));
      minima[4 * i + 2 * t] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(two)));
      minima[4 * i + 2 * t + 1] = vreinterpretq_s16_u16(vmovl_high_u8(two));
    }
  }
}

/* the 8 rows' minima dotted with an activation row's 8 sub-block sums (its 16 sums of 16, in pairs): rows 0..3, 4..7 */
static NEON_INLINE void k4_group_minima(const int16x8_t minima[8], const int16_t* sums, int32x4_t msum[2]) {
  const int16x8_t xs = vpaddq_s16(vld1q_s16(sums), vld1q_s16(sums + 8));
  int32x4_t lo = vmull_laneq_s16(vget_low_s16(minima[0]), xs, 0), hi = vmull_high_laneq_s16(minima[0], xs, 0);
#define MINIMA(s) \
  lo = vmlal_laneq_s16(lo, vget_low_s16(minima[s]), xs, s), hi = vmlal_high_laneq_s16(hi, minima[s], xs, s)
  MINIMA(1);
  MINIMA(2);
  MINIMA(3);
  MINIMA(4);
  MINIMA(5);
  MINIMA(6);
  MINIMA(7);
#undef MINIMA
  msum[0] = lo, msum[1] = hi;
}

/* a Q6_K group block's scale s of the 8 rows as int32, in the pairs' order */
static NEON_INLINE void q6_group_scale(const block_q6_Kx8* g, int s, int32x4_t out[2]) {
  const int16x8_t wide = vmovl_s8(vld1_s8(g->scales[s]));
  swap_pairs(vmovl_s16(vget_low_s16(wide)), vmovl_high_s16(wide), out);
}

#define USE_MMLA 0
#define LEVEL_ATTR NEON_DOTPROD
#define NAME(x) x##_dotprod
#include "gguf_neon_group_body.h"
#undef USE_MMLA
#undef LEVEL_ATTR
#undef NAME

#define USE_MMLA 1
#define LEVEL_ATTR NEON_I8MM
#define NAME(x) x##_i8mm
#include "gguf_neon_group_body.h"
#undef USE_MMLA
#undef LEVEL_ATTR
#undef NAME

#define NEON_GROUP(type, name) \
  case type: return i8mm ? group_##name##_i8mm : group_##name##_dotprod;
GroupDotFn neon_group_dot(int type, int level) {
  if (level < ARM_DOTPROD) return NULL;
  const int i8mm = level >= ARM_I8MM;
  switch (type) { GROUP_DOT_TYPES(NEON_GROUP) }
  return NULL;
}
#else
typedef int gguf_neon_group_is_arm64_only; /* an empty translation unit elsewhere */
#endif
