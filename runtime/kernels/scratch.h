/* Per-thread scratch memory kept between calls (ort_setup.c), so an op allocates nothing per step once it has grown. */
#pragma once
#include <stddef.h>

#define SCRATCH_TASK 0 /* a task's work: GgufMatMul's quantized rows, an attention task's row lists and scores */
#define SCRATCH_CALL 1 /* an op's own data for one call, beside its tasks (which may run on the calling thread) */
#define SCRATCH_ROW 2  /* a GgufMatMul task's row copied out of its group (grouped types without a group dot) */
#define SCRATCH_SLOTS 3

/* the calling thread's scratch `slot`, at least bytes; NULL when it cannot grow */
void* thread_scratch(int slot, size_t bytes);
