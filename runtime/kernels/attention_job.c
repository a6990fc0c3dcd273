/* attention_task(): which rows each query position sees, and the positions of a block attended together. */
#include "attention_job.h"

#include <stdlib.h>
#include <string.h>

size_t attention_tasks(const AttentionJob* job) {
  return (size_t)(job->b * job->hkv * ((job->s + BLOCK_ROWS - 1) / BLOCK_ROWS));
}

/* The rows that row r of sequence b sees through KV head h, in order, into keys/values; their number. */
static int64_t rows_seen(const AttentionJob* job, int64_t b, int64_t h, int64_t r, const void** keys, const void** values) {
  const AttentionKernel* kn = job->kn;
  const size_t row = (size_t)job->d * job->elem;
  int64_t n = 0;
  if (!kn->segmented) {
    const int64_t last = job->before[b] + r, first = kn->window > 0 && last + 1 > kn->window ? last + 1 - kn->window : 0;
    const size_t start = (size_t)((b * job->hkv + h) * job->capacity) * row;
    for (int64_t j = first; j <= last; j++, n++) {
      keys[n] = job->keys + start + (size_t)j * row;
      values[n] = job->values + start + (size_t)j * row;
    }
    return n;
  }
  for (int64_t j = 0; j < job->num_prompt; j++, n++) {
    keys[n] = (const char*)job->prompt[h] + (size_t)j * row;
    values[n] = (const char*)job->prompt[job->hkv + h] + (size_t)j * row;
  }
  const float* seen = job->bias + (b * job->s + r) * (job->past + job->s);
  const size_t start = (size_t)((b * job->hkv + h) * job->past) * row;
  for (int64_t j = 0; j < job->past; j++) {
    if (seen[j] != 0.0f) continue;
    keys[n] = job->keys + start + (size_t)j * row;
    values[n++] = job->values + start + (size_t)j * row;
  }
  for (int64_t j = 0; j < job->s; j++) {
    if (seen[job->past + j] != 0.0f) continue;
    if (kn->half) {
      const uint16_t* rounded = job->rounded + ((b * job->s + j) * 2 * job->hkv + h) * job->d;
      keys[n] = rounded;
      values[n++] = rounded + job->hkv * job->d;
    } else {
      keys[n] = job->k + ((b * job->s + j) * job->hkv + h) * job->d;
      values[n++] = job->v + ((b * job->s + j) * job->hkv + h) * job->d;
    }
  }
  return n;
}

/* one task: the g query heads of KV head h at rows r0 .. r0 + BLOCK_ROWS of sequence b, together where each row's
 * rows are the start of the last one's (causal rows), so that each key and value row is read once for all of them */
void attention_task(void* data, size_t task) {
  AttentionJob* job = data;
  const AttentionKernel* kn = job->kn;
  const int64_t blocks = (job->s + BLOCK_ROWS - 1) / BLOCK_ROWS;
  const int64_t r0 = (int64_t)task % blocks * BLOCK_ROWS, h = (int64_t)task / blocks % job->hkv;
  const int64_t b = (int64_t)task / blocks / job->hkv, g = job->g;
  const int64_t most = job->num_prompt + (kn->segmented ? job->past : job->capacity) + job->s;
  const int64_t num_vectors = BLOCK_ROWS * g;
  void* scratch = thread_scratch(SCRATCH_TASK, sizeof(void*) * 4 * (size_t)most + sizeof(int) * (size_t)num_vectors +
                             2 * sizeof(float*) * (size_t)num_vectors +
                             sizeof(float) * (size_t)attention_scratch((int)num_vectors, (int)most, (int)job->d));
  if (scratch == NULL) {
    job->failed = 1;
    return;
  }
  const void** keys = scratch;
  const void** values = keys + most;
  const void** mine = values + most; /* one row's own keys and values, to compare */
  const float** q = (const float**)(mine + 2 * most);
  float** out = (float**)(q + num_vectors);
  int* counts = (int*)(out + num_vectors);
  float* work = (float*)(counts + num_vectors);
  int64_t rows = job->s - r0 < BLOCK_ROWS ? job->s - r0 : BLOCK_ROWS;
  if (!kn->segmented) { /* padding rows: neither attended nor attending */
    const int64_t real = job->num_new[b] - r0;
    for (int64_t r = r0 + (real > 0 ? real : 0); r < r0 + rows; r++) {
      memset(job->out + ((b * job->s + r) * kn->num_heads + h * g) * job->d, 0, sizeof(float) * (size_t)(g * job->d));
    }
    rows = real < rows ? (real > 0 ? real : 0) : rows;
  }
  if (rows == 0) return;
  int together = kn->window == 0;
  const int64_t n = rows_seen(job, b, h, r0 + rows - 1, keys, values);
  int64_t seen[BLOCK_ROWS];
  seen[rows - 1] = n;
  for (int64_t r = 0; r < rows - 1; r++) {
    seen[r] = rows_seen(job, b, h, r0 + r, mine, mine + most);
    together = together && seen[r] <= n && memcmp(mine, keys, sizeof(void*) * (size_t)seen[r]) == 0;
  }
  for (int64_t r = 0; r < rows; r++) {
    if (!together) { /* each row by itself */
      const int64_t count = rows_seen(job, b, h, r0 + r, keys, values);
      for (int64_t i = 0; i < g; i++) {
        const int64_t at = ((b * job->s + r0 + r) * kn->num_heads + h * g + i) * job->d;
        q[i] = job->q + at;
        out[i] = job->out + at;
        counts[i] = (int)count;
      }
      attend(q, counts, (int)g, (int)job->d, kn->scale, keys, values, (int)count, kn->half, work, out);
      continue;
    }
    for (int64_t i = 0; i < g; i++) {
      const int64_t at = ((b * job->s + r0 + r) * kn->num_heads + h * g + i) * job->d;
      q[r * g + i] = job->q + at;
      out[r * g + i] = job->out + at;
      counts[r * g + i] = (int)seen[r];
    }
  }
  if (together) {
    attend(q, counts, (int)(rows * g), (int)job->d, kn->scale, keys, values, (int)n, kn->half, work, out);
  }
}

/* the new rows of sequence b into the buffers (converted to the cache's type) */
void write_rows(const AttentionJob* job, int64_t b, char* keys, char* values) {
  const size_t row = (size_t)job->d * job->elem;
  for (int64_t r = 0; r < job->num_new[b]; r++) {
    for (int64_t h = 0; h < job->hkv; h++) {
      const size_t at = ((size_t)((b * job->hkv + h) * job->capacity) + (size_t)(job->before[b] + r)) * row;
      const float* k = job->k + ((b * job->s + r) * job->hkv + h) * job->d;
      const float* v = job->v + ((b * job->s + r) * job->hkv + h) * job->d;
      if (job->kn->half) {
        to_half(k, (int)job->d, (uint16_t*)(keys + at));
        to_half(v, (int)job->d, (uint16_t*)(values + at));
      } else {
        memcpy(keys + at, k, row);
        memcpy(values + at, v, row);
      }
    }
  }
}
