/* One attention call's work, split into tasks for ORT's intra-op threads (attention_job.c); attention_ops.c reads
 * the op's tensors into an AttentionJob. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "scratch.h"

#define BLOCK_ROWS 4 /* query positions a task attends together */

/* an op's attributes, and its kind: in place (CachedAttention) or segmented (SegmentAttention), its KV type */
typedef struct {
  int segmented, half;
  int64_t num_heads, kv_num_heads, window;
  float scale;
} AttentionKernel;

typedef struct {
  const AttentionKernel* kn;
  int64_t b, s, hkv, d, g;
  size_t elem;
  const float *q, *k, *v;
  float* out;
  /* in place: the buffers [B, Hkv, C, D] and each sequence's rows before the step and new rows */
  const char *keys, *values;
  int64_t capacity;
  const int32_t *before, *num_new;
  /* segmented: the prompt rows per KV head [Pp, D], the response buffers [B, Hkv, P, D], the bias */
  const void* const* prompt;
  int64_t num_prompt, past;
  const float* bias;
  uint16_t* rounded; /* [B, S, 2 Hkv, D] the new rows as float16 (half caches) */
  int failed;
} AttentionJob;

/* the tasks of a call: B Hkv ceil(S / BLOCK_ROWS) */
size_t attention_tasks(const AttentionJob* job);
/* task: the g query heads of one KV head at BLOCK_ROWS positions of one sequence (ORT's ParallelFor signature) */
void attention_task(void* job, size_t task);
/* the new rows of sequence b into the in-place buffers, in the cache's type */
void write_rows(const AttentionJob* job, int64_t b, char* keys, char* values);
