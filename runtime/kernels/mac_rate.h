/* The int8 multiply-accumulate rate probes' shared part (gguf_avx2.c, gguf_neon.c): the probe's activations, and the
 * timing of its passes on the thread's own CPU clock. */
#ifndef STATICLM_MAC_RATE_H
#define STATICLM_MAC_RATE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "portable.h"

enum { PROBE_K = 4096, PROBE_ROWS = 4 };

/* [PROBE_ROWS * PROBE_K] int8 activations, 16 KB: they stay in L1, as a dot's activations do. */
static inline const int8_t* probe_activations(void) {
  static THREAD_LOCAL int8_t x[PROBE_ROWS * PROBE_K];
  for (int i = 0; i < PROBE_ROWS * PROBE_K; i++) x[i] = (int8_t)(i * 37);
  return x;
}

/* pass(state) dots every probe row once (PROBE_ROWS * PROBE_K MACs) into the accumulators `sums` (within state,
 * zeroed here), run until about `seconds` of the thread's CPU time have passed (other processes sharing the core do
 * not lower the rate), checked every 64 passes: MACs/s. */
static inline double timed_mac_rate(double seconds, void (*pass)(void* state), void* state, void* sums,
                                    size_t sums_bytes) {
  memset(sums, 0, sums_bytes);
  const double start = thread_cpu_seconds();
  double elapsed = 0.0, passes = 0.0;
  while (elapsed < seconds) {
    for (int i = 0; i < 64; i++) {
      pass(state);
      COMPILER_BARRIER(); /* each pass reads the activations again */
    }
    passes += 64;
    elapsed = thread_cpu_seconds() - start;
  }
  volatile unsigned char sink = 0; /* the sums are used: the passes are not removed */
  for (size_t i = 0; i < sums_bytes; i++) sink ^= ((const unsigned char*)sums)[i];
  (void)sink;
  return passes * PROBE_ROWS * PROBE_K / elapsed;
}

#endif
