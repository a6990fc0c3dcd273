/* The ARM64 kernels' shared pieces (gguf_neon*.c): unpacking levels and scales with base NEON (every ARM64 CPU has
 * it), and the attributes that let one function use the dot-product or matrix-multiply instructions while the rest
 * of the library stays ARMv8.0. ARM64 only. */
#pragma once
#include <arm_neon.h>

#include "gguf_neon.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* the portable dots' float order, not a fused multiply-add of it */
#endif
#if defined(__GNUC__) || defined(__clang__)
#define NEON_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define NEON_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#define NEON_INLINE __attribute__((always_inline)) inline
#else /* MSVC declares the intrinsics for every function */
#define NEON_DOTPROD
#define NEON_I8MM
#define NEON_INLINE __forceinline
#endif

/* tests/c/arm64_dots.sh -DSTATICLM_BREAK_DOT=<ggml type>: that type's levels unpacked wrong, to show that the test of
 * these dots fails when one is broken */
#ifdef STATICLM_BREAK_DOT
#define BROKEN(type) ((type) == STATICLM_BREAK_DOT)
#else
#define BROKEN(type) 0
#endif

/* n float16 at p (n = 4 or 8 rows' d) as float32: exact, as read_fp16 */
static NEON_INLINE float32x4_t fp16x4(const uint8_t* p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }

static NEON_INLINE float fp16_one(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

/* [sum a, sum b, sum c, sum d] of 4 vectors */
static NEON_INLINE int32x4_t sums4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
  return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

/* [inputs 0..15, 16..31]: byte i is 0xFF where bit i of qh is set (a 5-bit level's fifth bit) */
static NEON_INLINE void fifth_bits(uint32_t qh, uint8x16_t out[2]) {
  static const uint8_t spread[2][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
                                        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3}};
  static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(qh));
  for (int h = 0; h < 2; h++) out[h] = vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(spread[h])), vld1q_u8(bits));
}

/* A 32-input block's levels minus its type's mid (w = d (q - mid)): inputs 0..15 in lo, 16..31 in hi */
static NEON_INLINE void levels32_neon(const uint8_t* block, int type, int8x16_t* lo, int8x16_t* hi) {
  if (type == GGML_Q8_0) {
    const block_q8_0* q8 = (const block_q8_0*)block;
    *lo = vandq_s8(vld1q_s8(q8->qs), vdupq_n_s8(BROKEN(GGML_Q8_0) ? ~1 : ~0));
    *hi = vld1q_s8(q8->qs + 16);
    return;
  }
  const Block32 f = block32(type);
  const uint8x16_t raw = vld1q_u8(block + f.head);
  uint8x16_t l = vandq_u8(raw, vdupq_n_u8(BROKEN(type) ? 14 : 15)), h = vshrq_n_u8(raw, 4);
  if (f.five) {
    uint32_t qh;
    memcpy(&qh, block + f.head - 4, 4);
    uint8x16_t set[2];
    fifth_bits(qh, set);
    if (f.mid) { /* Q5_0: q - 16 is the low bits, minus 16 where the fifth bit is clear (0xF0 is -16) */
      *lo = vreinterpretq_s8_u8(vaddq_u8(l, vbicq_u8(vdupq_n_u8(0xF0), set[0])));
      *hi = vreinterpretq_s8_u8(vaddq_u8(h, vbicq_u8(vdupq_n_u8(0xF0), set[1])));
      return;
    }
    l = vorrq_u8(l, vandq_u8(set[0], vdupq_n_u8(16)));
    h = vorrq_u8(h, vandq_u8(set[1], vdupq_n_u8(16)));
  }
  *lo = vsubq_s8(vreinterpretq_s8_u8(l), vdupq_n_s8((int8_t)f.mid));
  *hi = vsubq_s8(vreinterpretq_s8_u8(h), vdupq_n_s8((int8_t)f.mid));
}

/* Q6_K's 32 levels of part q (0..3) of a half, minus 32, from the bytes of ql's first 32 (ql0), its second 32 (ql1)
 * and qh (q6_level: part q takes ql0 or ql1 by q & 1, low or high nibble by q >> 1, and qh's bits 2q, 2q + 1) */
static NEON_INLINE int8x16_t q6_part(uint8x16_t ql0, uint8x16_t ql1, uint8x16_t qh, int q) {
  const uint8x16_t m3 = vdupq_n_u8(BROKEN(GGML_Q6_K) ? 1 : 3);
  uint8x16_t v;
  switch (q) {
    case 0: v = vsliq_n_u8(ql0, vandq_u8(qh, m3), 4); break;
    case 1: v = vsliq_n_u8(ql1, vandq_u8(vshrq_n_u8(qh, 2), m3), 4); break;
    case 2: v = vsliq_n_u8(vshrq_n_u8(ql0, 4), vandq_u8(vshrq_n_u8(qh, 4), m3), 4); break;
    default: v = vsliq_n_u8(vshrq_n_u8(ql1, 4), vshrq_n_u8(qh, 6), 4); break;
  }
  return vsubq_s8(vreinterpretq_s8_u8(v), vdupq_n_s8(32));
}

/* bytes n, n + 4, n + 8, n + 12 (byte n of each 32-bit lane) as int32 */
static NEON_INLINE int32x4_t lane_byte(uint32x4_t words, int n) {
  return vreinterpretq_s32_u32(vandq_u32(vshlq_u32(words, vdupq_n_s32(-8 * n)), vdupq_n_u32(0xff)));
}

/* [0, 1, 4, 5] and [2, 3, 6, 7] (the pairs' order, gguf_dot.h) <-> [0, 1, 2, 3] and [4, 5, 6, 7] */
static NEON_INLINE void swap_pairs(int32x4_t a, int32x4_t b, int32x4_t out[2]) {
  out[0] = vreinterpretq_s32_s64(vzip1q_s64(vreinterpretq_s64_s32(a), vreinterpretq_s64_s32(b)));
  out[1] = vreinterpretq_s32_s64(vzip2q_s64(vreinterpretq_s64_s32(a), vreinterpretq_s64_s32(b)));
}
