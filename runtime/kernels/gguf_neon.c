/* Which ARM64 dots this CPU runs, asked of the operating system once: Linux's hardware capability bits, macOS's
 * sysctl, Windows' processor features. An unknown system takes the portable dots. */
#if defined(__aarch64__) || defined(_M_ARM64)
#include <stdlib.h>
#include <string.h>

#include "gguf_neon.h"

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
    if (wanted != NULL) {
      const int cap = !strcmp(wanted, "portable") ? ARM_PORTABLE : !strcmp(wanted, "dotprod") ? ARM_DOTPROD : ARM_I8MM;
      if (cap < level) level = cap;
    }
    cached = level;
  }
  return cached;
}
#else
typedef int gguf_neon_is_arm64_only; /* an empty translation unit elsewhere */
#endif
