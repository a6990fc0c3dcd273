/* GGUF's block layouts (gguf-py's quants module is the reference) and the 8-bit activation rows they are dotted with.
 *
 * A weight row [K] is K / block_elems blocks of block_bytes each, stored as the file stores them. An activation row
 * is quantized once per call to int8 with one float scale per block of the weight type's activation block:
 * 256 for the K-quants (with the sum of every 16 levels, for the K-quants' minima and Q6_K's offset), 32 for the
 * others. Every dot is then integer products and one float multiply per block, as llama.cpp's CPU kernels do. */
#pragma once
#include <stdint.h>
#include <string.h>

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };
enum { QK_K = 256, QK_0 = 32 };

/* The blocks as the file stores them (ggml's block_* structs; float16 fields as their two bytes, so that a struct
 * has no padding and any byte address holds one). */
typedef struct {
  uint8_t d[2];
  uint8_t qs[16]; /* levels 0..15 in the low nibbles, 16..31 in the high; w = d (q - 8) */
} block_q4_0;
typedef struct {
  uint8_t d[2], m[2];
  uint8_t qs[16]; /* as Q4_0's; w = d q + m */
} block_q4_1;
typedef struct {
  uint8_t d[2];
  uint8_t qh[4]; /* bit i: level i's fifth bit */
  uint8_t qs[16];
} block_q5_0;
typedef struct {
  uint8_t d[2], m[2];
  uint8_t qh[4];
  uint8_t qs[16];
} block_q5_1;
typedef struct {
  uint8_t d[2];
  int8_t qs[32];
} block_q8_0;
typedef struct {
  uint8_t d[2], dmin[2];
  uint8_t scales[12]; /* 8 six-bit scales and minima (k_scale_min) */
  uint8_t qs[128];    /* sub-blocks 2c and 2c + 1 in the low and high nibbles of bytes 32c .. 32c + 31 */
} block_q4_K;
typedef struct {
  uint8_t d[2], dmin[2];
  uint8_t scales[12];
  uint8_t qh[32]; /* bit j of byte l: the fifth bit of sub-block j's level l */
  uint8_t qs[128];
} block_q5_K;
typedef struct {
  uint8_t ql[128]; /* the levels' low 4 bits, qh[64] their high 2 (q6_level) */
  uint8_t qh[64];
  int8_t scales[16]; /* one per 16 levels */
  uint8_t d[2];
} block_q6_K;
_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 &&
               sizeof(block_q5_1) == 24 && sizeof(block_q8_0) == 34, "the 32-input blocks as GGUF stores them");
_Static_assert(sizeof(block_q4_K) == 144 && sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210,
               "the K-quant super-blocks as GGUF stores them");

typedef struct {
  int type, block_elems, block_bytes, act_block; /* act_block: inputs per activation scale */
} BlockFormat;

static inline int block_format(int type, BlockFormat* f) {
  switch (type) {
    case GGML_Q4_0: *f = (BlockFormat){type, QK_0, sizeof(block_q4_0), QK_0}; return 1;
    case GGML_Q4_1: *f = (BlockFormat){type, QK_0, sizeof(block_q4_1), QK_0}; return 1;
    case GGML_Q5_0: *f = (BlockFormat){type, QK_0, sizeof(block_q5_0), QK_0}; return 1;
    case GGML_Q5_1: *f = (BlockFormat){type, QK_0, sizeof(block_q5_1), QK_0}; return 1;
    case GGML_Q8_0: *f = (BlockFormat){type, QK_0, sizeof(block_q8_0), QK_0}; return 1;
    case GGML_Q4_K: *f = (BlockFormat){type, QK_K, sizeof(block_q4_K), QK_K}; return 1;
    case GGML_Q5_K: *f = (BlockFormat){type, QK_K, sizeof(block_q5_K), QK_K}; return 1;
    case GGML_Q6_K: *f = (BlockFormat){type, QK_K, sizeof(block_q6_K), QK_K}; return 1;
    default: return 0;
  }
}

/* One activation row: q [K] int8, d [K / act_block] float, sums [K / 16] int16 (sum of each 16 levels), and
 * scaled [K / 32] float (each 32 levels' sum times their block's d: what a K-quant's minima are dotted with). */
typedef struct {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  const float* scaled;
} ActRow;

static inline float fp16_to_fp32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { /* subnormal: normalize */
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline float read_fp16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (0..7) from the 12 packed bytes. */
static inline void k_scale_min(int j, const uint8_t* s, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* Q4_K / Q5_K's 12 scale bytes -> 8 scales (bytes 0..7) and 8 minima (bytes 8..15), in 32-bit words */
static inline void k4_scales(const uint8_t* packed, uint32_t out[4]) {
  uint32_t u[3];
  memcpy(u, packed, 12);
  out[0] = u[0] & 0x3f3f3f3f;                                           /* scales 0..3: low 6 bits */
  out[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);     /* scales 4..7 */
  out[2] = u[1] & 0x3f3f3f3f;                                           /* minima 0..3 */
  out[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4); /* minima 4..7 */
}

/* The 32-input types: a block's 32 levels, unsigned, and what stands for zero: w = d (q - mid) for Q4_0, Q5_0 and
 * Q8_0 (mid 8, 16, 0; Q8_0's levels are signed bytes), w = d q + m for Q4_1 and Q5_1 (their minimum m). */
typedef struct {
  int bytes, head, five, minimum, mid; /* head: bytes before the nibbles (d, [m], [qh]) */
} Block32;

static inline Block32 block32(int type) {
  switch (type) {
    case GGML_Q4_0: return (Block32){18, 2, 0, 0, 8};
    case GGML_Q5_0: return (Block32){22, 6, 1, 0, 16};
    case GGML_Q4_1: return (Block32){20, 4, 0, 1, 0};
    case GGML_Q5_1: return (Block32){24, 8, 1, 1, 0};
    default: return (Block32){34, 2, 0, 0, 0}; /* Q8_0 */
  }
}
