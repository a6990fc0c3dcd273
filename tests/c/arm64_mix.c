/* One ARM64 dot run over a small matrix, `repeats` times: tests/c/arm64_mix.sh counts the instructions qemu-user
 * executes for 1 and 2 repeats, so that the difference is one pass's instruction count (what the README's ARM64
 * table reports per 256 weights and activation row).
 * argv: level (dotprod | i8mm), ggml type number, layout (rows | groups), tile height (1..8), repeats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_dot.h"
#include "gguf_neon.h"

enum { K = 1024, N = 16 };

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int level = !strcmp(argv[1], "i8mm") ? ARM_I8MM : ARM_DOTPROD, type = atoi(argv[2]);
  const int grouped = !strcmp(argv[3], "groups"), tile = atoi(argv[4]), repeats = atoi(argv[5]);
  BlockFormat f = {0, 1, 1, 1};
  if (!block_format(type, &f) || tile < 1 || tile > TILE) return 2;
  const int row_bytes = K / f.block_elems * f.block_bytes;
  static uint8_t w[N * (K / QK_0) * 34];
  for (int i = 0; i < N * row_bytes; i++) w[i] = (uint8_t)(i * 37 + (i >> 7));
  for (int i = 0; i < N * row_bytes; i += f.block_bytes) w[i + (type == GGML_Q6_K ? 209 : 1)] = 0x1c; /* finite d */
  static float x[TILE * K], out[TILE * N], d[TILE * K / QK_0], scaled[TILE * K / 32];
  static int8_t q[TILE * K];
  static int16_t sums[TILE * K / 16];
  ActRow a[TILE];
  for (int r = 0; r < tile; r++) {
    for (int i = 0; i < K; i++) x[r * K + i] = (float)((i * 7 + r) % 23) - 11.0f;
    quantize_act_row(x + r * K, K, f.act_block, q + r * K, d + r * (K / f.act_block), sums + r * (K / 16),
                     scaled + r * (K / 32), 1);
    a[r] = (ActRow){q + r * K, d + r * (K / f.act_block), sums + r * (K / 16), scaled + r * (K / 32)};
  }
  const DotFn dot = neon_dot(type, level);
  const GroupDotFn group = neon_group_dot(type, level);
  if (grouped ? group == NULL : dot == NULL) return 3;
  for (int rep = 0; rep < repeats; rep++) {
    for (int n = 0; n < N; n += grouped ? GROUP : 1) {
      if (grouped) group(w + n * row_bytes, a, tile, K, out + n, N);
      else dot(w + n * row_bytes, a, tile, K, out + n, N);
    }
  }
  printf("%g\n", (double)out[0]);
  return 0;
}
