/* Attention over a list of cached rows, one query position at a time (attention.c).
 *
 * A query row's result depends only on its query and on the key and value rows it sees, in the order it sees them:
 * never on the rows beside it in the step, on how many steps its keys were written in, or on which buffers hold
 * them. The lane's in-place graphs and the segmented graphs (a shared prompt segment, a response buffer, the new
 * rows) therefore give a row the same bits (tests/test_attention_op.py), which ORT's GroupQueryAttention and the
 * segmented graphs' MatMul and Softmax nodes do not. */
#pragma once
#include <stdint.h>

/* q[p]: num_vectors query vectors of d floats (a KV head's query heads, at one or more positions); vector p sees the
 * first counts[p] of the n rows keys[j] / values[j] (d elements each of the cache's type; half: float16, else
 * float32); scratch: attention_scratch() floats; out[p] (d floats) = softmax_j(scale q[p] . k_j) v_j, zeros when
 * counts[p] is 0. Vector p's result is the same whatever vectors are beside it and whatever rows follow its own. */
void attend(const float* const* q, const int* counts, int num_vectors, int d, float scale, const void* const* keys,
            const void* const* values, int n, int half, float* scratch, float* const* out);

/* floats of scratch that attend() needs */
int64_t attention_scratch(int num_vectors, int n, int d);

/* float32 <-> float16 (round to nearest even), as the cache stores a new row */
void to_half(const float* x, int n, uint16_t* y);
