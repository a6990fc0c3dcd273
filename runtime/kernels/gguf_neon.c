/* Which ARM64 dots this CPU runs, asked of the operating system once: Linux's hardware capability bits, macOS's
 * sysctl, Windows' processor features. An unknown system takes the portable dots. And the int8 rate probe (the
 * bench's ceiling, as gguf_avx2.c's on x86-64). */
#if defined(__aarch64__) || defined(_M_ARM64)
#include <stdlib.h>
#include <string.h>

#include "gguf_neon_parts.h"
#include "mac_rate.h"
#include "portable.h"

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#elif defined(_WIN32)
#include <windows.h>
#endif

#if defined(__APPLE__)
static int sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof(value);
  return sysctlbyname(name, &value, &size, NULL, 0) == 0 && value != 0;
}
#endif

static int cpu_level(void) {
  int dotprod = 0, i8mm = 0;
#if defined(__linux__)
  dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  i8mm = (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#elif defined(__APPLE__)
  dotprod = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
#elif defined(_WIN32)
  dotprod = IsProcessorFeaturePresent(PF_ARM_V82_DP_INSTRUCTIONS_AVAILABLE) != 0;
#ifdef PF_ARM_V82_I8MM_INSTRUCTIONS_AVAILABLE /* newer SDKs only: without it, Windows takes the dot products */
  i8mm = IsProcessorFeaturePresent(PF_ARM_V82_I8MM_INSTRUCTIONS_AVAILABLE) != 0;
#endif
#endif
  return dotprod ? (i8mm ? ARM_I8MM : ARM_DOTPROD) : ARM_PORTABLE;
}

int arm_dot_level(void) {
  static int cached = -1; /* racing threads compute the same value */
  if (cached < 0) {
    int level = cpu_level();
    const char* wanted = getenv("STATICLM_ARM_DOTS");
    if (wanted != NULL && *wanted != '\0') {
      const int cap = !strcmp(wanted, "portable") ? ARM_PORTABLE : !strcmp(wanted, "dotprod") ? ARM_DOTPROD : ARM_I8MM;
      if (cap < level) level = cap;
    }
    cached = level;
  }
  return cached;
}

struct dotprod_probe {
  const int8_t* x;
  int32x4_t acc[PROBE_ROWS];
};

NEON_DOTPROD static void dotprod_probe_pass(void* state) {
  _Static_assert(PROBE_ROWS == 4, "one accumulator a row below");
  struct dotprod_probe* p = state;
  const int8x16_t levels = vdupq_n_s8(11);
  const int8_t* x = p->x;
  /* in registers through the pass (the activations are chars: they may alias p) */
  int32x4_t a0 = p->acc[0], a1 = p->acc[1], a2 = p->acc[2], a3 = p->acc[3];
  for (int i = 0; i < PROBE_K; i += 16, x += 16) {
    a0 = vdotq_s32(a0, levels, vld1q_s8(x));
    a1 = vdotq_s32(a1, levels, vld1q_s8(x + PROBE_K));
    a2 = vdotq_s32(a2, levels, vld1q_s8(x + 2 * PROBE_K));
    a3 = vdotq_s32(a3, levels, vld1q_s8(x + 3 * PROBE_K));
  }
  p->acc[0] = a0, p->acc[1] = a1, p->acc[2] = a2, p->acc[3] = a3;
}

NEON_DOTPROD static double int8_mac_rate_dotprod(double seconds) {
  struct dotprod_probe probe;
  probe.x = probe_activations();
  return timed_mac_rate(seconds, dotprod_probe_pass, &probe, probe.acc, sizeof probe.acc);
}

/* The calling thread's int8 multiply-accumulate rate through sdot, the instruction the ARM64 dots are built on,
 * the inputs read from L1: MACs per second of the thread's own CPU time over about `seconds` of it; 0 without the
 * dot products. */
STATICLM_EXPORT double staticlm_int8_mac_rate(double seconds) {
  return arm_dot_level() >= ARM_DOTPROD ? int8_mac_rate_dotprod(seconds) : 0.0;
}
#else
typedef int gguf_neon_is_arm64_only; /* an empty translation unit elsewhere */
#endif
