/* Dots of GGUF weight rows with 8-bit activation rows, and rows dequantized to float (the embedding's gather).
 *
 * Each type has a portable dot and a vector dot picked at run time: on x86-64 with AVX2 (the same integer sums, so they
 * agree exactly up to the order of the float additions), on ARM64 with the dot-product instructions (the same sums
 * and the same float order: bit for bit the portable result, gguf_neon.h). */
#include "gguf_dot.h"

#include <math.h>
#include <stdlib.h>

#include "gguf_avx2.h"
#include "gguf_neon.h"
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* the float order the vector dots repeat (gguf_neon.h) */
#endif

/* ---- activations ---------------------------------------------------------------------------------------------- */

static void quantize_act_row_portable(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums) {
  for (int b = 0; b < k / act_block; b++) {
    const float* xb = x + b * act_block;
    float amax = 0.0f;
    for (int i = 0; i < act_block; i++) amax = fmaxf(amax, fabsf(xb[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    for (int i = 0; i < act_block; i++) q[b * act_block + i] = (int8_t)lrintf(xb[i] * inv);
  }
  for (int s = 0; s < k / 16; s++) {
    int total = 0;
    for (int i = 0; i < 16; i++) total += q[s * 16 + i];
    sums[s] = (int16_t)total;
  }
}

void quantize_act_row(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums, float* scaled,
                      int portable) {
#if HAS_X86
  if (!portable && have_avx2()) {
    quantize_act_row_avx2(x, k, act_block, q, d, sums);
  } else
#endif
  {
    (void)portable;
    quantize_act_row_portable(x, k, act_block, q, d, sums);
  }
  for (int j = 0; j < k / 32; j++) scaled[j] = d[j * 32 / act_block] * (float)(sums[2 * j] + sums[2 * j + 1]);
}

/* ---- portable dots -------------------------------------------------------------------------------------------- */

static void levels32(int type, const uint8_t* w, int q[32]) {
  const Block32 f = block32(type);
  if (type == GGML_Q8_0) {
    for (int i = 0; i < 32; i++) q[i] = (int8_t)w[2 + i];
    return;
  }
  uint32_t qh = 0;
  if (f.five) memcpy(&qh, w + f.head - 4, 4);
  for (int i = 0; i < 16; i++) {
    q[i] = (w[f.head + i] & 15) | (int)(((qh >> i) & 1) << 4);
    q[16 + i] = (w[f.head + i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
  }
}

/* blocks_apart: 1 for a row as the file has it, GROUP for a row of a grouped matrix (gguf_dot.h), read in place */
static float dot_32(int type, const uint8_t* w, ActRow a, int k, int blocks_apart) {
  const Block32 f = block32(type);
  float total = 0.0f;
  for (int b = 0; b < k / QK_0; b++, w += f.bytes * blocks_apart) {
    int q[32], sum = 0;
    levels32(type, w, q);
    for (int i = 0; i < 32; i++) sum += (q[i] - f.mid) * a.q[b * 32 + i];
    const int level_sum = a.sums[2 * b] + a.sums[2 * b + 1];
    total += a.d[b] * (read_fp16(w) * (float)sum + (f.minimum ? read_fp16(w + 2) * (float)level_sum : 0.0f));
  }
  return total;
}

static float dot_q4_0(const uint8_t* w, ActRow a, int k) { return dot_32(GGML_Q4_0, w, a, k, 1); }
static float dot_q5_0(const uint8_t* w, ActRow a, int k) { return dot_32(GGML_Q5_0, w, a, k, 1); }
static float dot_q4_1(const uint8_t* w, ActRow a, int k) { return dot_32(GGML_Q4_1, w, a, k, 1); }
static float dot_q5_1(const uint8_t* w, ActRow a, int k) { return dot_32(GGML_Q5_1, w, a, k, 1); }
static float dot_q8_0(const uint8_t* w, ActRow a, int k) { return dot_32(GGML_Q8_0, w, a, k, 1); }

/* Q4_K and Q5_K: sub-block j of 32 is 4 low bits from qs (64 inputs per 32 bytes, low nibbles first) and, for
 * Q5_K, bit j of qh[l]; w = d sc_j q - dmin m_j. */
static float dot_k4(const uint8_t* w, ActRow a, int k, int five) {
  const int bytes = five ? 176 : 144;
  float total = 0.0f;
  for (int b = 0; b < k / QK_K; b++, w += bytes) {
    const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
    const int8_t* q8 = a.q + b * QK_K;
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
      uint8_t sc, m;
      k_scale_min(j, w + 4, &sc, &m);
      int dot = 0;
      for (int l = 0; l < 32; l++) {
        int q = (qs[(j / 2) * 32 + l] >> (4 * (j & 1))) & 15;
        if (five) q |= ((qh[l] >> j) & 1) << 4;
        dot += q * q8[j * 32 + l];
      }
      isum += sc * dot;
      msum += m * (a.sums[b * 16 + 2 * j] + a.sums[b * 16 + 2 * j + 1]);
    }
    total += a.d[b] * (read_fp16(w) * (float)isum - read_fp16(w + 2) * (float)msum);
  }
  return total;
}

static float dot_q4_k(const uint8_t* w, ActRow a, int k) { return dot_k4(w, a, k, 0); }
static float dot_q5_k(const uint8_t* w, ActRow a, int k) { return dot_k4(w, a, k, 1); }

/* Q6_K: 6-bit levels (4 low bits in ql, 2 high in qh), an int8 scale per 16, w = d sc (q - 32). */
static inline int q6_level(const uint8_t* blk, int e) {
  const int half = e / 128, r = e % 128, l = r % 32, part = r / 32;
  const uint8_t* ql = blk + 64 * half;
  const uint8_t* qh = blk + 128 + 32 * half;
  const int low = (part & 1) ? ql[l + 32] : ql[l];
  return (((part < 2) ? low & 15 : low >> 4) | (((qh[l] >> (2 * part)) & 3) << 4));
}

static float dot_q6_k(const uint8_t* w, ActRow a, int k) {
  float total = 0.0f;
  for (int b = 0; b < k / QK_K; b++, w += 210) {
    const int8_t* sc = (const int8_t*)(w + 192);
    const int8_t* q8 = a.q + b * QK_K;
    int isum = 0;
    for (int s = 0; s < 16; s++) {
      int dot = 0;
      for (int i = 0; i < 16; i++) dot += q6_level(w, s * 16 + i) * q8[s * 16 + i];
      isum += sc[s] * (dot - 32 * a.sums[b * 16 + s]);
    }
    total += read_fp16(w + 208) * a.d[b] * (float)isum;
  }
  return total;
}

/* ---- the dots by type, vector where the CPU has them ------------------------------------------------------------------------------------------------ */

/* Returns kind's vector function for a type (Fn: its type) where the CPU has one and portable is not asked for:
 * avx2_##kind where the CPU has AVX2, neon_##kind at the CPU's level on ARM64 (where NULL goes on to the portable
 * one) */
#if HAS_X86
#define RETURN_VECTOR(Fn, kind, type, portable) \
  if (!(portable) && have_avx2()) return avx2_##kind(type)
#elif HAS_ARM64
#define RETURN_VECTOR(Fn, kind, type, portable)                                  \
  do {                                                                           \
    const Fn neon = (portable) ? NULL : neon_##kind((type), arm_dot_level());   \
    if (neon != NULL) return neon;                                               \
  } while (0)
#else
#define RETURN_VECTOR(Fn, kind, type, portable) (void)(portable)
#endif

/* Fn kind##_function(int type, int portable): the vector function where RETURN_VECTOR finds one, else list's
 * portable CASE for the type, else NULL */
#define BY_TYPE(Fn, kind, list, CASE)                 \
  Fn kind##_function(int type, int portable) {        \
    RETURN_VECTOR(Fn, kind, type, portable);          \
    switch (type) { list(CASE) }                      \
    return NULL;                                      \
  }

typedef float (*RowDot)(const uint8_t* w, ActRow a, int k);

#define PORTABLE_ROWS(name, single)                                                                            \
  static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) {         \
    for (int r = 0; r < rows; r++) out[r * stride] = single(w, a[r], k);                                     \
  }
PORTABLE_ROWS(rows_q4_0, dot_q4_0)
PORTABLE_ROWS(rows_q5_0, dot_q5_0)
PORTABLE_ROWS(rows_q8_0, dot_q8_0)
PORTABLE_ROWS(rows_q4_1, dot_q4_1)
PORTABLE_ROWS(rows_q5_1, dot_q5_1)
PORTABLE_ROWS(rows_q4_k, dot_q4_k)
PORTABLE_ROWS(rows_q5_k, dot_q5_k)
PORTABLE_ROWS(rows_q6_k, dot_q6_k)

/* dot_function (gguf_dot.h): the vector dot where the CPU has one, else the portable rows_<name> */
#define PORTABLE_DOT(type, name) \
  case type: return rows_##name;
BY_TYPE(DotFn, dot, ROW_DOT_TYPES, PORTABLE_DOT)

/* a group's rows one by one, each read in place (its blocks GROUP apart): the same sums as a plain row's */
#define PORTABLE_GROUP(name, type)                                                                              \
  static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) {         \
    for (int j = 0; j < GROUP; j++) {                                                                           \
      for (int r = 0; r < rows; r++) out[r * stride + j] = dot_32(type, w + j * block32(type).bytes, a[r], k, GROUP); \
    }                                                                                                           \
  }
PORTABLE_GROUP(group_q4_0, GGML_Q4_0)
PORTABLE_GROUP(group_q5_0, GGML_Q5_0)
PORTABLE_GROUP(group_q4_1, GGML_Q4_1)
PORTABLE_GROUP(group_q5_1, GGML_Q5_1)

/* row j's 32 bytes of 4 eighths placed as a group block's are (gguf_dot.h), copied back in order */
static void eighths_row(const EighthOf8Rows eighths[4], int j, uint8_t* out) {
  const int h = (j >> 1) & 1, i = (j & 1) | (j >> 2) << 1;
  for (int e = 0; e < 4; e++) memcpy(out + 8 * e, eighths[e][h][i], 8);
}

void k4_group_block(const uint8_t* g, int j, uint8_t block[144]) {
  const block_q4_Kx8* group = (const block_q4_Kx8*)g;
  block_q4_K* row = (block_q4_K*)block;
  memcpy(row->d, group->d[j], 2);
  memcpy(row->dmin, group->dmin[j], 2);
  for (int u = 0; u < 3; u++) memcpy(row->scales + 4 * u, group->scale_words[u][j], 4);
  for (int c = 0; c < 4; c++) eighths_row(group->qs[c], j, row->qs + 32 * c);
}

void q6_group_block(const uint8_t* g, int j, uint8_t block[210]) {
  const block_q6_Kx8* group = (const block_q6_Kx8*)g;
  block_q6_K* row = (block_q6_K*)block;
  memcpy(row->d, group->d[j], 2);
  for (int s = 0; s < 16; s++) row->scales[s] = group->scales[s][j];
  for (int t = 0; t < 2; t++) {
    eighths_row(group->levels[t][0], j, row->ql + 64 * t);
    eighths_row(group->levels[t][1], j, row->ql + 64 * t + 32);
    eighths_row(group->levels[t][2], j, row->qh + 32 * t);
  }
}

/* Q4_K, Q6_K by groups: each row's blocks put back one at a time as the file has them, each block dotted as the plain
 * row's dot does it and its term added to the row's running sum in the same order: the same sums, and no buffer of
 * a whole row (whose length only K decides; C11 compilers need not have arrays of run-time length, MSVC has none) */
static ActRow act_block(ActRow a, int b) { /* the activation row's part under super-block b */
  return (ActRow){a.q + b * QK_K, a.d + b, a.sums + b * (QK_K / 16), a.scaled + b * (QK_K / 32)};
}

#define PORTABLE_BLOCK_GROUP(name, block_bytes, group_bytes, unpack, single)                                  \
  static void name(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride) {         \
    float total[TILE][GROUP] = {{0.0f}}; /* [row of a][row of the group] */                                    \
    uint8_t block[block_bytes];                                                                               \
    for (int b = 0; b < k / QK_K; b++) {                                                                      \
      for (int j = 0; j < GROUP; j++) {                                                                       \
        unpack(w + b * group_bytes, j, block);                                                                \
        for (int r = 0; r < rows; r++) total[r][j] += single(block, act_block(a[r], b), QK_K);               \
      }                                                                                                       \
    }                                                                                                         \
    for (int r = 0; r < rows; r++) {                                                                          \
      for (int j = 0; j < GROUP; j++) out[r * stride + j] = total[r][j];                                      \
    }                                                                                                         \
  }
PORTABLE_BLOCK_GROUP(group_q4_k, 144, K4_GROUP_BYTES, k4_group_block, dot_q4_k)
PORTABLE_BLOCK_GROUP(group_q6_k, 210, Q6_GROUP_BYTES, q6_group_block, dot_q6_k)

/* group_dot_function (gguf_dot.h): the vector group dot where the CPU has one, else the portable group_<name> */
#define PORTABLE_GROUP_DOT(type, name) \
  case type: return group_##name;
BY_TYPE(GroupDotFn, group_dot, GROUP_DOT_TYPES, PORTABLE_GROUP_DOT)

/* ---- dequantization (gguf-py's arithmetic, so a gathered row equals gguf's dequantization bit for bit) -------- */

void dequantize_row(int type, const uint8_t* w, int k, float* y) {
  switch (type) {
    case GGML_Q4_0:
    case GGML_Q5_0:
    case GGML_Q4_1:
    case GGML_Q5_1:
    case GGML_Q8_0: {
      const Block32 f = block32(type);
      for (int b = 0; b < k / QK_0; b++, w += f.bytes, y += 32) {
        const float d = read_fp16(w), m = f.minimum ? read_fp16(w + 2) : 0.0f;
        int q[32];
        levels32(type, w, q);
        for (int i = 0; i < 32; i++) y[i] = f.minimum ? d * (float)q[i] + m : d * (float)(q[i] - f.mid);
      }
      return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
      const int five = type == GGML_Q5_K, bytes = five ? 176 : 144;
      for (int b = 0; b < k / QK_K; b++, w += bytes, y += QK_K) {
        const float d = read_fp16(w), dmin = read_fp16(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
          uint8_t sc, m;
          k_scale_min(j, w + 4, &sc, &m);
          const float ds = d * (float)sc, dm = dmin * (float)m;
          for (int l = 0; l < 32; l++) {
            int q = (qs[(j / 2) * 32 + l] >> (4 * (j & 1))) & 15;
            if (five) q |= ((qh[l] >> j) & 1) << 4;
            y[j * 32 + l] = ds * (float)q - dm;
          }
        }
      }
      return;
    }
    case GGML_Q6_K:
      for (int b = 0; b < k / QK_K; b++, w += 210, y += QK_K) {
        const float d = read_fp16(w + 208);
        const int8_t* sc = (const int8_t*)(w + 192);
        for (int e = 0; e < QK_K; e++) y[e] = (d * (float)sc[e / 16]) * (float)(q6_level(w, e) - 32);
      }
      return;
  }
}
