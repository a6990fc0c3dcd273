/* The ARM64 kernels (gguf_neon*.c): NEON with the dot-product instructions (FEAT_DotProd, sdot), and for the groups
 * with two activation rows and more, the 8-bit matrix multiply (FEAT_I8MM, smmla), each where the CPU has it (asked
 * at run time, so that one library runs on every ARM64 CPU). Every dot computes the portable dot's integer sums and
 * then its float expression in its order: the result is the portable dot's, bit for bit, wherever the compiler does
 * not contract a multiply and an add into one (C11 mode, or -ffp-contract=off; clang is told so in each file). */
#pragma once
#include "gguf_dot.h"

#if defined(__aarch64__) || defined(_M_ARM64)
#define HAS_ARM64 1
enum { ARM_PORTABLE = 0, ARM_DOTPROD = 1, ARM_I8MM = 2 };
/* what this CPU runs; STATICLM_ARM_DOTS=portable|dotprod|i8mm in the environment lowers it (never raises it) */
int arm_dot_level(void);
DotFn neon_dot(int type, int level);             /* NULL: no NEON dot for that type at that level */
GroupDotFn neon_group_dot(int type, int level);  /* likewise */
#else
#define HAS_ARM64 0
#endif
