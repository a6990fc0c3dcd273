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

typedef struct {
  int type, block_elems, block_bytes, act_block; /* act_block: inputs per activation scale */
} BlockFormat;

static inline int block_format(int type, BlockFormat* f) {
  switch (type) {
    case GGML_Q4_0: *f = (BlockFormat){type, QK_0, 18, QK_0}; return 1;
    case GGML_Q4_1: *f = (BlockFormat){type, QK_0, 20, QK_0}; return 1;
    case GGML_Q5_0: *f = (BlockFormat){type, QK_0, 22, QK_0}; return 1;
    case GGML_Q5_1: *f = (BlockFormat){type, QK_0, 24, QK_0}; return 1;
    case GGML_Q8_0: *f = (BlockFormat){type, QK_0, 34, QK_0}; return 1;
    case GGML_Q4_K: *f = (BlockFormat){type, QK_K, 144, QK_K}; return 1;
    case GGML_Q5_K: *f = (BlockFormat){type, QK_K, 176, QK_K}; return 1;
    case GGML_Q6_K: *f = (BlockFormat){type, QK_K, 210, QK_K}; return 1;
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
