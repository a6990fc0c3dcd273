/* The AVX2 kernels (gguf_avx2*.c): x86-64 only, used where have_avx2(). */
#pragma once
#include "gguf_dot.h"

#if defined(__x86_64__) || defined(_M_X64)
#define HAS_X86 1
int have_avx2(void);
DotFn avx2_dot(int type);
GroupDotFn avx2_group_dot(int type);
float dot_k4_one(const uint8_t* w, const ActRow* a, int k, int five); /* one activation row */
float dot_q6_k_one(const uint8_t* w, const ActRow* a, int k);
void quantize_act_row_avx2(const float* x, int k, int act_block, int8_t* q, float* d, int16_t* sums);
#else
#define HAS_X86 0
#endif
