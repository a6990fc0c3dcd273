#pragma once
#include "gguf_blocks.h"

#define TILE 8 /* activation rows one call dots a weight row with */

/* w: one weight row (k / block_elems blocks); a: rows (1..TILE) activation rows quantized for its type;
 * out[r * stride] = w . a[r] */
typedef void (*DotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);

/* portable: the scalar dot even where AVX2 is available (the tests compare both). NULL for a type without one. */
DotFn dot_function(int type, int portable);

/* A weight matrix stored by groups of GROUP rows (GgufMatMul's row_group attribute, written by the exporter): the
 * group's blocks interleaved, block b of its row j at (b * GROUP + j) * block_bytes from the group's start, so that
 * a group is read as one stream. w: a group's start; out[r * stride + j] = row j . a[r] for j < GROUP. */
#define GROUP 8
typedef void (*GroupDotFn)(const uint8_t* w, const ActRow* a, int rows, int k, float* out, int64_t stride);
/* the group dot (AVX2, or the portable rows read in place), or NULL where the type has none: the rows are then
 * copied out of the group one by one and dotted with the type's DotFn */
GroupDotFn group_dot_function(int type, int portable);

/* x [k] -> q [k] int8, d [k / act_block] (q * d ~ x), sums [k / 16] (each 16 levels summed), scaled [k / 32]
 * (each 32 levels' sum times d); act_block is a multiple of 32 */
void quantize_act_row(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums, float* scaled,
                      int portable);

void dequantize_row(int type, const uint8_t* w, int k, float* y);
