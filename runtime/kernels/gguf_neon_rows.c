/* The ARM64 dots of one weight row (as the file stores it) with a tile of up to TILE activation rows, with the
 * dot-product instruction (sdot: 16 int8 products into 4 int32 lanes): a block's levels are unpacked once for all
 * the rows. Each row's integer sums are the portable dot's, then its float expression in the portable order
 * (gguf_neon.h). */
#if defined(__aarch64__) || defined(_M_ARM64)
#include "gguf_neon_parts.h"

/* 32 levels (lo: inputs 0..15, hi: 16..31) times x's 32: 4 lanes whose sum is the dot */
NEON_DOTPROD static NEON_INLINE int32x4_t dot32(int8x16_t lo, int8x16_t hi, const int8_t* x) {
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(x)), hi, vld1q_s8(x + 16));
}

/* v's first n lanes from p, the rest 0 (a row's last blocks) */
static NEON_INLINE float32x4_t load_f32(const float* p, int n) {
  if (n == 4) return vld1q_f32(p);
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int i = 0; i < n; i++) v[i] = p[i];
  return vld1q_f32(v);
}

/* each 2 of 2n int16 level sums from p added: n int32 (n <= 4), the rest 0 */
static NEON_INLINE int32x4_t pair_sums(const int16_t* p, int n) {
  int16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  memcpy(v, p, 2 * (size_t)n * sizeof(int16_t));
  const int16x8_t s = vld1q_s16(v);
  return vmovl_s16(vget_low_s16(vpaddq_s16(s, s)));
}

/* Q4_0, Q5_0, Q8_0, Q4_1, Q5_1: `count` (1..4, a constant) blocks from w at a time, their sums as one vector and
 * their float terms as one, which are then added into each row's total one block after another, as the portable
 * dot adds them. */
NEON_DOTPROD static NEON_INLINE void blocks_32(const uint8_t* w, const ActRow* a, const int rows, int b0,
                                               float total[TILE], const int type, const int count) {
  const Block32 f = block32(type);
  int8x16_t lo[4], hi[4];
  uint8_t dh[4][2] = {{0}}, mh[4][2] = {{0}}; /* the blocks' d and m (float16) */
  for (int i = 0; i < count; i++) {
    levels32_neon(w + i * f.bytes, type, &lo[i], &hi[i]);
    memcpy(dh[i], w + i * f.bytes, 2);
    if (f.minimum) memcpy(mh[i], w + i * f.bytes + 2, 2);
  }
  const float32x4_t d = fp16x4(dh[0]), m = fp16x4(mh[0]);
  for (int r = 0; r < rows; r++) {
    const int8_t* x = a[r].q + b0 * QK_0;
    int32x4_t s[4];
    for (int i = 0; i < 4; i++) s[i] = i < count ? dot32(lo[i], hi[i], x + 32 * i) : vdupq_n_s32(0);
    /* per block: a.d (d sum [+ m level_sum]); the portable dot's "+ 0" for the types without a minimum changes no
     * total (a zero's sign never reaches it) */
    float32x4_t t = vmulq_f32(d, vcvtq_f32_s32(sums4(s[0], s[1], s[2], s[3])));
    if (f.minimum) t = vaddq_f32(t, vmulq_f32(m, vcvtq_f32_s32(pair_sums(a[r].sums + 2 * b0, count))));
    t = vmulq_f32(load_f32(a[r].d + b0, count), t);
    total[r] += vgetq_lane_f32(t, 0);
    if (count > 1) total[r] += vgetq_lane_f32(t, 1);
    if (count > 2) total[r] += vgetq_lane_f32(t, 2);
    if (count > 3) total[r] += vgetq_lane_f32(t, 3);
  }
}

NEON_DOTPROD static NEON_INLINE void rows_32(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                             int64_t stride, const int type) {
  const int bytes = block32(type).bytes, num_blocks = k / QK_0;
  float total[TILE];
  for (int r = 0; r < rows; r++) total[r] = 0.0f;
  int b0 = 0;
  for (; b0 + 4 <= num_blocks; b0 += 4) blocks_32(w + b0 * bytes, a, rows, b0, total, type, 4);
  switch (num_blocks - b0) { /* the row's last blocks */
    case 3: blocks_32(w + b0 * bytes, a, rows, b0, total, type, 3); break;
    case 2: blocks_32(w + b0 * bytes, a, rows, b0, total, type, 2); break;
    case 1: blocks_32(w + b0 * bytes, a, rows, b0, total, type, 1); break;
  }
  for (int r = 0; r < rows; r++) out[r * stride] = total[r];
}

/* Q4_K, Q5_K: a super-block's 8 sub-blocks of levels unpacked once, each row's 8 sums weighted by the 6-bit scales,
 * the minima dotted with the row's sub-block sums, in integers; then the portable dot's float expression. */
NEON_DOTPROD static NEON_INLINE void rows_k4(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                             int64_t stride, const int five) {
  const int bytes = five ? (int)sizeof(block_q5_K) : (int)sizeof(block_q4_K);
  const uint8x16_t m4 = vdupq_n_u8(BROKEN(five ? GGML_Q5_K : GGML_Q4_K) ? 14 : 15), sixteen = vdupq_n_u8(16);
  float total[TILE];
  for (int r = 0; r < rows; r++) total[r] = 0.0f;
  for (int b = 0; b < k / QK_K; b++, w += bytes) {
    uint32_t sm[4]; /* 8 scales, then 8 minima, as bytes */
    k4_scales(w + 4, sm);
    const uint16x8_t scales16 = vmovl_u8(vld1_u8((const uint8_t*)sm));
    const int32x4_t scales[2] = {vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(scales16))),
                                 vreinterpretq_s32_u32(vmovl_high_u16(scales16))};
    const int16x8_t minima = vreinterpretq_s16_u16(vmovl_u8(vld1_u8((const uint8_t*)sm + 8)));
    const uint8_t* qs = w + (five ? 48 : 16);
    uint8x16_t qh[2] = {vdupq_n_u8(0), vdupq_n_u8(0)}; /* shifted right by one per sub-block */
    if (five) qh[0] = vld1q_u8(w + 16), qh[1] = vld1q_u8(w + 32);
    int8x16_t levels[8][2]; /* [sub-block]: inputs 0..15, 16..31 */
    for (int c = 0; c < 4; c++) {
      for (int h = 0; h < 2; h++) {
        const uint8x16_t raw = vld1q_u8(qs + 32 * c + 16 * h);
        uint8x16_t lo = vandq_u8(raw, m4), hi = vshrq_n_u8(raw, 4);
        if (five) {
          lo = vorrq_u8(lo, vandq_u8(vshlq_n_u8(qh[h], 4), sixteen));
          hi = vorrq_u8(hi, vandq_u8(vshlq_n_u8(qh[h], 3), sixteen));
          qh[h] = vshrq_n_u8(qh[h], 2);
        }
        levels[2 * c][h] = vreinterpretq_s8_u8(lo);
        levels[2 * c + 1][h] = vreinterpretq_s8_u8(hi);
      }
    }
    const float d = fp16_one(w), dmin = fp16_one(w + 2);
    for (int r = 0; r < rows; r++) {
      const int8_t* x = a[r].q + b * QK_K;
      int32x4_t s[8];
      for (int j = 0; j < 8; j++) s[j] = dot32(levels[j][0], levels[j][1], x + 32 * j);
      const int isum = vaddvq_s32(vmlaq_s32(vmulq_s32(sums4(s[0], s[1], s[2], s[3]), scales[0]),
                                            sums4(s[4], s[5], s[6], s[7]), scales[1]));
      const int16x8_t xs = vpaddq_s16(vld1q_s16(a[r].sums + 16 * b), vld1q_s16(a[r].sums + 16 * b + 8));
      const int msum = vaddvq_s32(vmlal_high_s16(vmull_s16(vget_low_s16(minima), vget_low_s16(xs)), minima, xs));
      total[r] += a[r].d[b] * (d * (float)isum - dmin * (float)msum);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = total[r];
}

/* Q6_K: the 16 sub-blocks of 16 levels (minus 32: the offset taken off in the products) each one sdot per row,
 * weighted by the int8 scales in integers; then the portable dot's float expression. */
NEON_DOTPROD static NEON_INLINE void rows_q6_k(const uint8_t* w, const ActRow* a, const int rows, int k, float* out,
                                               int64_t stride) {
  float total[TILE];
  for (int r = 0; r < rows; r++) total[r] = 0.0f;
  for (int b = 0; b < k / QK_K; b++, w += sizeof(block_q6_K)) {
    const block_q6_K* blk = (const block_q6_K*)w;
    const int8x16_t sc8 = vld1q_s8(blk->scales);
    const int16x8_t sc16[2] = {vmovl_s8(vget_low_s8(sc8)), vmovl_high_s8(sc8)};
    const int32x4_t scales[4] = {vmovl_s16(vget_low_s16(sc16[0])), vmovl_high_s16(sc16[0]),
                                 vmovl_s16(vget_low_s16(sc16[1])), vmovl_high_s16(sc16[1])};
    int8x16_t levels[16]; /* [sub-block of 16] */
    for (int t = 0; t < 2; t++) {
      for (int v = 0; v < 2; v++) { /* inputs 16 v .. 16 v + 15 of each part */
        const uint8x16_t ql0 = vld1q_u8(blk->ql + 64 * t + 16 * v), ql1 = vld1q_u8(blk->ql + 64 * t + 32 + 16 * v);
        const uint8x16_t qh = vld1q_u8(blk->qh + 32 * t + 16 * v);
        for (int q = 0; q < 4; q++) levels[8 * t + 2 * q + v] = q6_part(ql0, ql1, qh, q);
      }
    }
    const float d = fp16_one(blk->d);
    for (int r = 0; r < rows; r++) {
      const int8_t* x = a[r].q + b * QK_K;
      int32x4_t s[16];
      for (int i = 0; i < 16; i++) s[i] = vdotq_s32(vdupq_n_s32(0), levels[i], vld1q_s8(x + 16 * i));
      int32x4_t isum = vmulq_s32(sums4(s[0], s[1], s[2], s[3]), scales[0]);
      for (int i = 1; i < 4; i++) {
        isum = vmlaq_s32(isum, sums4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]), scales[i]);
      }
      total[r] += d * a[r].d[b] * (float)vaddvq_s32(isum);
    }
  }
  for (int r = 0; r < rows; r++) out[r * stride] = total[r];
}

/* one function per type and tile height, so that each loop over rows has a constant count */
#define NEON_TILED(name, call)                                                                                \
  NEON_DOTPROD static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) { \
    BY_COUNT(rows, call)                                                                                         \
  }
/* CALL_<type>(n): the type's dot of n activation rows, made one function by NEON_TILED_DOT below */
#define CALL_q4_0(n) rows_32(w, a, n, k, out, stride, GGML_Q4_0)
#define CALL_q5_0(n) rows_32(w, a, n, k, out, stride, GGML_Q5_0)
#define CALL_q8_0(n) rows_32(w, a, n, k, out, stride, GGML_Q8_0)
#define CALL_q4_1(n) rows_32(w, a, n, k, out, stride, GGML_Q4_1)
#define CALL_q5_1(n) rows_32(w, a, n, k, out, stride, GGML_Q5_1)
#define CALL_q4_k(n) rows_k4(w, a, n, k, out, stride, 0)
#define CALL_q5_k(n) rows_k4(w, a, n, k, out, stride, 1)
#define CALL_q6_k(n) rows_q6_k(w, a, n, k, out, stride)

#define NEON_TILED_DOT(type, name) NEON_TILED(dot_##name##_neon, CALL_##name)
ROW_DOT_TYPES(NEON_TILED_DOT)

#define NEON_DOT(type, name) \
  case type: return dot_##name##_neon;
DotFn neon_dot(int type, int level) {
  if (level < ARM_DOTPROD) return NULL;
  switch (type) { ROW_DOT_TYPES(NEON_DOT) }
  return NULL;
}
#else
typedef int gguf_neon_rows_is_arm64_only; /* an empty translation unit elsewhere */
#endif
