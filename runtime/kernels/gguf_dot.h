#pragma once
#include "gguf_blocks.h"

#define TILE 8 /* activation rows one call dots a weight row with */

/* w: one weight row (k / block_elems blocks); a: rows (1..TILE) activation rows quantized for its type;
 * out[r * stride] = w . a[r] */
typedef void (*DotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);

/* portable: the scalar dot even where AVX2 is available (the tests compare both). NULL for a type without one. */
DotFn dot_function(int type, int portable);

/* A weight matrix stored by groups of GROUP rows (GgufMatMul's row_group attribute, written by the exporter), so
 * that a group is read as one stream. The group's blocks are interleaved: block b of its row j at
 * (b * GROUP + j) * block_bytes from the group's start. w: a group's start; out[r * stride + j] = row j . a[r].
 *
 * Q4_K goes one step further: the 8 blocks b of a group (8 x 144 bytes) are one "group block" whose bytes are
 * rearranged so that the levels need no shuffle at run time (every byte kept, only moved; k4_group_block undoes it):
 *   [0, 16)     d of rows 0..7 (float16)             [16, 32)  dmin of rows 0..7
 *   [32, 128)   the 12 scale bytes as 3 words: word u of row j at 32 + 4 (8 u + j)
 *   [128, 1152) qs: chunk c (the file's bytes 16 + 32 c .. + 32 of each row: sub-blocks 2 c in the low nibbles,
 *               2 c + 1 in the high) at 128 + 256 c; within it, the 8 bytes l = 8 e .. 8 e + 7 of row j at
 *               64 e + 32 h + 8 i, where h = (j >> 1) & 1 and i = (j & 1) | (j >> 2) << 1 (rows 0, 1, 4, 5 in
 *               h = 0; 2, 3, 6, 7 in h = 1): 32 bytes of 4 rows that one vector multiplies by 8 inputs at once. */
#define GROUP 8
#define K4_GROUP_BYTES (GROUP * 144)
void k4_group_block(const uint8_t* g, int j, uint8_t block[144]); /* row j's Q4_K block from a group block */
/* Q6_K's group block likewise:
 *   [0, 16)     d of rows 0..7 (float16)             [16, 144)  the int8 scales: scale s of row j at 16 + 8 s + j
 *   [144, 1680) half t of the levels (the file's ql bytes 64 t .. + 64 and qh bytes 32 t .. + 32 of each row) at
 *               144 + 768 t: ql's first 32 bytes, its second 32, then qh's 32, each 256 bytes of 8 rows placed as
 *               Q4_K's chunks are (row j's bytes 8 e .. 8 e + 7 at 64 e + 32 h + 8 i). */
#define Q6_GROUP_BYTES (GROUP * 210)
void q6_group_block(const uint8_t* g, int j, uint8_t block[210]); /* row j's Q6_K block from a group block */
typedef void (*GroupDotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);
/* the group dot (AVX2, or the portable rows read in place), or NULL where the type has none: the rows are then
 * copied out of the group one by one and dotted with the type's DotFn */
GroupDotFn group_dot_function(int type, int portable);

/* x [k] -> q [k] int8, d [k / act_block] (q * d ~ x), sums [k / 16] (each 16 levels summed), scaled [k / 32]
 * (each 32 levels' sum times d); act_block is a multiple of 32 */
void quantize_act_row(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums, float* scaled,
                      int portable);

void dequantize_row(int type, const uint8_t* w, int k, float* y);
