/* The ARM64 dots (runtime/kernels/gguf_neon*.c) against the portable dots, run on an ARM64 CPU or under qemu-user
 * by tests/c/arm64_dots.sh (which tests/test_arm64_dots.py runs). No ONNX Runtime: the dots' own C.
 *
 * For every type, both layouts (a weight row as the file stores it; a group of 8 rows as the exporter writes it,
 * written here from the group structs of gguf_dot.h) and every tile height 1..8, at each level this CPU has
 * (dotprod, i8mm): the result equals the portable dot's bit for bit. The portable dot itself is checked against
 * the double-precision product of gguf's dequantization (dequantize_row) with the quantized activations. The run-time
 * choice is checked against the level named on the command line: argv[1] = portable | dotprod | i8mm.
 * Prints one line per failure and "N passed, N failed"; exits 1 on any failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_dot.h"
#include "gguf_neon.h"

#define MAX_K 768
#define NUM_ROWS 13 /* a plain matrix's rows: odd */
#define NUM_GROUPED 16 /* a grouped matrix's rows: two groups */
#define MAX_ROW_BYTES (MAX_K / QK_K * 210 > MAX_K / QK_0 * 34 ? MAX_K / QK_K * 210 : MAX_K / QK_0 * 34)

static const struct { int type; const char* name; int grouped; } TYPES[] = {
    {GGML_Q4_0, "Q4_0", 1}, {GGML_Q4_1, "Q4_1", 1}, {GGML_Q5_0, "Q5_0", 1}, {GGML_Q5_1, "Q5_1", 1},
    {GGML_Q8_0, "Q8_0", 0}, {GGML_Q4_K, "Q4_K", 1}, {GGML_Q5_K, "Q5_K", 0}, {GGML_Q6_K, "Q6_K", 1}};
static const char* LEVELS[] = {"portable", "dotprod", "i8mm"};
static int num_passed, num_failed;

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_random(void) {
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return (uint32_t)(state >> 16);
}

static void check(int ok, const char* what, const char* name, const char* layout, const char* level, int k,
                  int rows, int row) {
  if (ok) {
    num_passed++;
    return;
  }
  if (num_failed++ < 20) printf("FAIL %s %s %s %s k=%d tile=%d row=%d\n", what, name, layout, level, k, rows, row);
}

/* a float16 in [2^-10, 2^-1) of either sign, as its bits */
static void random_fp16(uint8_t* p) {
  const uint32_t sign = next_random() & 1, exponent = 5 + next_random() % 10, mantissa = next_random() & 0x3ff;
  const uint16_t bits = (uint16_t)(sign << 15 | exponent << 10 | mantissa);
  memcpy(p, &bits, 2);
}

/* k / block_elems random blocks: every level and scale byte random, the float16 fields finite */
static void random_row(int type, int k, uint8_t* row) {
  BlockFormat f = {0, 1, 1, 1};
  block_format(type, &f);
  for (int i = 0; i < k / f.block_elems * f.block_bytes; i++) row[i] = (uint8_t)next_random();
  for (int b = 0; b < k / f.block_elems; b++) {
    uint8_t* block = row + b * f.block_bytes;
    if (type == GGML_Q6_K) {
      random_fp16(block + 208);
    } else {
      random_fp16(block);
      if (type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K) random_fp16(block + 2);
    }
  }
}

/* 8 rows as one group (gguf_dot.h's structs), the way the exporter writes them */
static void group_rows(int type, int k, const uint8_t* rows, int row_bytes, uint8_t* out) {
  BlockFormat f = {0, 1, 1, 1};
  block_format(type, &f);
  for (int b = 0; b < k / f.block_elems; b++) {
    uint8_t* at = out + b * GROUP * f.block_bytes;
    for (int j = 0; j < GROUP; j++) {
      const uint8_t* block = rows + j * row_bytes + b * f.block_bytes;
      const int h = (j >> 1) & 1, i = (j & 1) | (j >> 2) << 1; /* the row's half and slot in an eighth */
      if (type == GGML_Q4_K) {
        block_q4_Kx8* g = (block_q4_Kx8*)at;
        const block_q4_K* r = (const block_q4_K*)block;
        memcpy(g->d[j], r->d, 2), memcpy(g->dmin[j], r->dmin, 2);
        for (int u = 0; u < 3; u++) memcpy(g->scale_words[u][j], r->scales + 4 * u, 4);
        for (int c = 0; c < 4; c++) {
          for (int e = 0; e < 4; e++) memcpy(g->qs[c][e][h][i], r->qs + 32 * c + 8 * e, 8);
        }
      } else if (type == GGML_Q6_K) {
        block_q6_Kx8* g = (block_q6_Kx8*)at;
        const block_q6_K* r = (const block_q6_K*)block;
        memcpy(g->d[j], r->d, 2);
        for (int s = 0; s < 16; s++) g->scales[s][j] = r->scales[s];
        for (int t = 0; t < 2; t++) {
          for (int e = 0; e < 4; e++) {
            memcpy(g->levels[t][0][e][h][i], r->ql + 64 * t + 8 * e, 8);
            memcpy(g->levels[t][1][e][h][i], r->ql + 64 * t + 32 + 8 * e, 8);
            memcpy(g->levels[t][2][e][h][i], r->qh + 32 * t + 8 * e, 8);
          }
        }
      } else {
        memcpy(at + j * f.block_bytes, block, (size_t)f.block_bytes);
      }
    }
  }
}

typedef struct {
  int8_t q[TILE * MAX_K];
  float d[TILE * MAX_K / QK_0], scaled[TILE * MAX_K / 32];
  int16_t sums[TILE * MAX_K / 16];
  ActRow rows[TILE];
} Activations;

static void quantize(Activations* act, int k, int act_block) {
  float x[MAX_K];
  for (int r = 0; r < TILE; r++) {
    for (int i = 0; i < k; i++) x[i] = ((float)(next_random() % 20001) - 10000.0f) * 1e-4f * (1.0f + (float)(i % 7));
    ActRow* a = &act->rows[r];
    int8_t* q = act->q + r * k;
    float *d = act->d + r * (k / act_block), *scaled = act->scaled + r * (k / 32);
    int16_t* sums = act->sums + r * (k / 16);
    quantize_act_row(x, k, act_block, q, d, sums, scaled, 1);
    *a = (ActRow){q, d, sums, scaled};
  }
}

/* the portable dot against gguf's dequantization times the quantized activations, in double */
static void check_portable(int t, int k, const uint8_t* rows, int row_bytes, const Activations* act) {
  BlockFormat f = {0, 1, 1, 1};
  block_format(TYPES[t].type, &f);
  const DotFn dot = dot_function(TYPES[t].type, 1);
  for (int n = 0; n < NUM_ROWS; n++) {
    float w[MAX_K], got[TILE];
    dequantize_row(TYPES[t].type, rows + n * row_bytes, k, w);
    dot(rows + n * row_bytes, act->rows, TILE, k, got, 1);
    for (int r = 0; r < TILE; r++) {
      double want = 0.0, scale = 0.0;
      for (int i = 0; i < k; i++) {
        const double product = (double)w[i] * act->rows[r].q[i] * act->rows[r].d[i / f.act_block];
        want += product, scale += fabs(product);
      }
      check(fabs(got[r] - want) <= 1e-5 * scale + 1e-30, "portable-vs-dequantized", TYPES[t].name, "rows",
            "portable", k, TILE, n);
    }
  }
}

/* a plain matrix: each weight row with each tile of activation rows, the vector dot against the portable one */
static void check_rows(int t, int level, int k, const uint8_t* rows, int row_bytes, const Activations* act) {
  const DotFn vector = neon_dot(TYPES[t].type, level), portable = dot_function(TYPES[t].type, 1);
  if (vector == NULL) {
    check(0, "no-dot", TYPES[t].name, "rows", LEVELS[level], k, 0, 0);
    return;
  }
  for (int tile = 1; tile <= TILE; tile++) {
    for (int first = 0; first + tile <= TILE; first += tile) {
      float got[TILE * NUM_ROWS], want[TILE * NUM_ROWS];
      for (int n = 0; n < NUM_ROWS; n++) {
        vector(rows + n * row_bytes, act->rows + first, tile, k, got + n, NUM_ROWS);
        portable(rows + n * row_bytes, act->rows + first, tile, k, want + n, NUM_ROWS);
      }
      for (int n = 0; n < NUM_ROWS; n++) {
        int same = 1;
        for (int r = 0; r < tile; r++) same &= !memcmp(&got[r * NUM_ROWS + n], &want[r * NUM_ROWS + n], 4);
        check(same, "vector-vs-portable", TYPES[t].name, "rows", LEVELS[level], k, tile, n);
      }
    }
  }
}

/* a grouped matrix: the group dot at this level against the portable dot of each row as the file stores it */
static void check_groups(int t, int level, int k, const uint8_t* rows, int row_bytes, const Activations* act) {
  static uint8_t grouped[NUM_GROUPED * MAX_ROW_BYTES];
  const int type = TYPES[t].type;
  for (int g = 0; g < NUM_GROUPED / GROUP; g++) {
    group_rows(type, k, rows + g * GROUP * row_bytes, row_bytes, grouped + g * GROUP * row_bytes);
  }
  if (type == GGML_Q4_K || type == GGML_Q6_K) { /* the kernels' unpacking gives back each row's blocks */
    const int block_bytes = type == GGML_Q4_K ? 144 : 210;
    for (int j = 0; j < GROUP; j++) {
      uint8_t block[210];
      (type == GGML_Q4_K ? k4_group_block : q6_group_block)(grouped, j, block);
      check(!memcmp(block, rows + j * row_bytes, (size_t)block_bytes), "group-block-unpacked", TYPES[t].name,
            "groups", "portable", k, 0, j);
    }
  }
  const GroupDotFn vector = level ? neon_group_dot(type, level) : group_dot_function(type, 1);
  const DotFn portable = dot_function(type, 1);
  if (vector == NULL) {
    check(0, "no-group-dot", TYPES[t].name, "groups", LEVELS[level], k, 0, 0);
    return;
  }
  for (int tile = 1; tile <= TILE; tile++) {
    float got[TILE * NUM_GROUPED], want[TILE * NUM_GROUPED];
    for (int g = 0; g < NUM_GROUPED / GROUP; g++) {
      vector(grouped + g * GROUP * row_bytes, act->rows + TILE - tile, tile, k, got + g * GROUP, NUM_GROUPED);
    }
    for (int n = 0; n < NUM_GROUPED; n++) {
      portable(rows + n * row_bytes, act->rows + TILE - tile, tile, k, want + n, NUM_GROUPED);
    }
    for (int n = 0; n < NUM_GROUPED; n++) {
      int same = 1;
      for (int r = 0; r < tile; r++) same &= !memcmp(&got[r * NUM_GROUPED + n], &want[r * NUM_GROUPED + n], 4);
      check(same, "vector-vs-portable", TYPES[t].name, "groups", LEVELS[level], k, tile, n);
    }
  }
}

int main(int argc, char** argv) {
  int expected = -1;
  for (int l = 0; l < 3; l++) expected = argc > 1 && !strcmp(argv[1], LEVELS[l]) ? l : expected;
  if (expected < 0) {
    fprintf(stderr, "usage: %s portable|dotprod|i8mm (the level this CPU must take)\n", argv[0]);
    return 2;
  }
  const int level = arm_dot_level();
  check(level == expected, "dispatch-level", LEVELS[level], "-", LEVELS[expected], 0, 0, 0);
  static uint8_t rows[NUM_GROUPED * MAX_ROW_BYTES];
  static Activations act;
  for (size_t t = 0; t < sizeof(TYPES) / sizeof(TYPES[0]); t++) {
    const int type = TYPES[t].type;
    const DotFn chosen = dot_function(type, 0);
    check(chosen == (level ? neon_dot(type, level) : dot_function(type, 1)), "dispatch", TYPES[t].name, "rows",
          LEVELS[level], 0, 0, 0);
    if (TYPES[t].grouped) {
      check(group_dot_function(type, 0) == (level ? neon_group_dot(type, level) : group_dot_function(type, 1)),
            "dispatch", TYPES[t].name, "groups", LEVELS[level], 0, 0, 0);
    }
    BlockFormat f = {0, 1, 1, 1};
    block_format(type, &f);
    static const int ks_32[] = {32, 96, 224, 768}, ks_k[] = {256, 768};
    const int* ks = f.block_elems == QK_K ? ks_k : ks_32;
    const int num_ks = f.block_elems == QK_K ? 2 : 4;
    for (int ki = 0; ki < num_ks; ki++) {
      const int k = ks[ki], row_bytes = k / f.block_elems * f.block_bytes;
      for (int n = 0; n < NUM_GROUPED; n++) random_row(type, k, rows + n * row_bytes);
      quantize(&act, k, f.act_block);
      check_portable((int)t, k, rows, row_bytes, &act);
      for (int l = ARM_DOTPROD; l <= level; l++) check_rows((int)t, l, k, rows, row_bytes, &act);
      for (int l = level ? ARM_DOTPROD : ARM_PORTABLE; TYPES[t].grouped && l <= level; l++) {
        check_groups((int)t, l, k, rows, row_bytes, &act);
      }
    }
  }
  printf("%s: %d passed, %d failed\n", LEVELS[level], num_passed, num_failed);
  return num_failed ? 1 : 0;
}
