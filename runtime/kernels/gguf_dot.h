#pragma once
#include "gguf_blocks.h"

#define TILE 8 /* activation rows one call dots a weight row with */

/* w: one weight row (k / block_elems blocks); a: rows (1..TILE) activation rows quantized for its type;
 * out[r * stride] = w . a[r] */
typedef void (*DotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);

/* call(n) with n a constant: 1..8 (a count outside them: 1), so that a loop over n unrolls and keeps registers */
#define BY_COUNT(count, call) \
  switch (count) {            \
    case 8: call(8); break;   \
    case 7: call(7); break;   \
    case 6: call(6); break;   \
    case 5: call(5); break;   \
    case 4: call(4); break;   \
    case 3: call(3); break;   \
    case 2: call(2); break;   \
    default: call(1); break;  \
  }

/* The types with a row dot and those with a group dot (GROUP below), each as X(GGML type, its name in the dots'
 * function names): every dispatch by type (portable, AVX2, NEON) is one switch over these lists. */
#define ROW_DOT_TYPES(X) \
  X(GGML_Q4_0, q4_0) X(GGML_Q5_0, q5_0) X(GGML_Q8_0, q8_0) X(GGML_Q4_1, q4_1) X(GGML_Q5_1, q5_1) \
  X(GGML_Q4_K, q4_k) X(GGML_Q5_K, q5_k) X(GGML_Q6_K, q6_k)
#define GROUP_DOT_TYPES(X) \
  X(GGML_Q4_0, q4_0) X(GGML_Q5_0, q5_0) X(GGML_Q4_1, q4_1) X(GGML_Q5_1, q5_1) X(GGML_Q4_K, q4_k) X(GGML_Q6_K, q6_k)

/* portable: the scalar dot even where AVX2 or ARM's dot products are available (the tests compare both). NULL for a
 * type without one. */
DotFn dot_function(int type, int portable);

/* A weight matrix stored by groups of GROUP rows (GgufMatMul's row_group attribute, written by the exporter's
 * group_rows in export/cpu/linear_parts.py), so that a group is read as one stream: its blocks b of the 8 rows, one
 * struct below per type, then its blocks b + 1. w: a group's start; out[r * stride + j] = row j . a[r]. Every byte of
 * the rows is kept, only moved. */
#define GROUP 8

/* Q4_0, Q4_1, Q5_0, Q5_1: the 8 rows' blocks b side by side, as the file has each (block b of row j at
 * (b * GROUP + j) * block_bytes from the group's start) */
typedef struct { block_q4_0 rows[GROUP]; } block_q4_0x8;
typedef struct { block_q4_1 rows[GROUP]; } block_q4_1x8;
typedef struct { block_q5_0 rows[GROUP]; } block_q5_0x8;
typedef struct { block_q5_1 rows[GROUP]; } block_q5_1x8;
_Static_assert(sizeof(block_q4_0x8) == GROUP * 18 && sizeof(block_q4_1x8) == GROUP * 20 &&
               sizeof(block_q5_0x8) == GROUP * 22 && sizeof(block_q5_1x8) == GROUP * 24, "a group's blocks b");

/* The 8 rows' levels of one eighth (8 inputs) as 4 pairs of rows: pair p holds rows K4_PAIR_ROWS[p] (16 bytes, 8 of
 * each row), the order in which one vector multiplies 8 inputs into 4 rows at once (x86's 32 bytes: half h =
 * (j >> 1) & 1 holds rows 0, 1, 4, 5 or 2, 3, 6, 7; ARM's 16: one pair, i8mm's 2 x 8 operand). Row j's 8 bytes are at
 * [half h][slot i], i = (j & 1) | (j >> 2) << 1. */
typedef uint8_t EighthOf8Rows[2][4][8]; /* [half h][slot i][byte] */
#define K4_PAIR_ROWS {{0, 1}, {4, 5}, {2, 3}, {6, 7}} /* [pair]: rows, in memory order (slot pairs of each half) */

/* Q4_K: the 8 rows' super-blocks b as one group block whose levels need no shuffle at run time (k4_group_block
 * undoes it). */
typedef struct {
  uint8_t d[GROUP][2];              /* row j's d (float16) */
  uint8_t dmin[GROUP][2];           /* row j's dmin */
  uint8_t scale_words[3][GROUP][4]; /* word u of row j's 12 scale bytes (k4_scales reads each row's 3 words) */
  EighthOf8Rows qs[4][4];           /* [chunk c][eighth e]: the file's qs bytes 32 c + 8 e .. + 8 of each row
                                       (sub-blocks 2 c in the low nibbles, 2 c + 1 in the high) */
} block_q4_Kx8;
_Static_assert(sizeof(block_q4_Kx8) == GROUP * sizeof(block_q4_K), "a Q4_K group block holds 8 super-blocks");
#define K4_GROUP_BYTES ((int)sizeof(block_q4_Kx8))
void k4_group_block(const uint8_t* g, int j, uint8_t block[144]); /* row j's Q4_K block from a group block */

/* Q6_K likewise: half t of the levels (the file's ql bytes 64 t .. + 64 and qh bytes 32 t .. + 32 of each row) as
 * three parts: ql's first 32 bytes, its second 32, then qh's 32, each by eighths as Q4_K's chunks are. */
typedef struct {
  uint8_t d[GROUP][2];           /* row j's d (float16) */
  int8_t scales[16][GROUP];      /* scale s of row j */
  EighthOf8Rows levels[2][3][4]; /* [half t][part][eighth e] */
} block_q6_Kx8;
_Static_assert(sizeof(block_q6_Kx8) == GROUP * sizeof(block_q6_K), "a Q6_K group block holds 8 super-blocks");
#define Q6_GROUP_BYTES ((int)sizeof(block_q6_Kx8))
void q6_group_block(const uint8_t* g, int j, uint8_t block[210]); /* row j's Q6_K block from a group block */
typedef void (*GroupDotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);
/* the group dot (AVX2, NEON, or the portable rows read in place), or NULL where the type has none: the rows are then
 * copied out of the group one by one and dotted with the type's DotFn */
GroupDotFn group_dot_function(int type, int portable);

/* x [k] -> q [k] int8, d [k / act_block] (q * d ~ x), sums [k / 16] (each 16 levels summed), scaled [k / 32]
 * (each 32 levels' sum times d); act_block is a multiple of 32 */
void quantize_act_row(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums, float* scaled,
                      int portable);

void dequantize_row(int type, const uint8_t* w, int k, float* y);
