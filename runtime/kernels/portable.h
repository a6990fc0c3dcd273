/* The few compiler-specific words the kernels library uses, so that its C builds with GCC, Clang, clang-cl and MSVC
 * alike: nothing GNU-only outside these #ifs. */
#pragma once

#if defined(_WIN32)
#define STATICLM_EXPORT __declspec(dllexport)
#elif defined(__GNUC__)
#define STATICLM_EXPORT __attribute__((visibility("default")))
#else
#define STATICLM_EXPORT
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define THREAD_LOCAL __declspec(thread)
#else
#define THREAD_LOCAL _Thread_local
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define ALWAYS_INLINE __forceinline
#define TARGET_AVX2 /* MSVC compiles AVX2 intrinsics in any function */
#else
#define ALWAYS_INLINE __attribute__((always_inline)) inline
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* an empty statement the compiler may not move memory accesses across */
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
#define COMPILER_BARRIER() _ReadWriteBarrier()
#else
#define COMPILER_BARRIER() __asm__ volatile("" ::: "memory")
#endif

/* the calling thread's CPU time, in seconds */
#if defined(_WIN32)
#include <windows.h>
static inline double thread_cpu_seconds(void) {
  FILETIME created, exited, kernel, user;
  GetThreadTimes(GetCurrentThread(), &created, &exited, &kernel, &user);
  const unsigned long long ticks = ((unsigned long long)user.dwHighDateTime << 32) | user.dwLowDateTime;
  return 1e-7 * (double)ticks; /* 100 ns ticks */
}
#else
#include <time.h>
static inline double thread_cpu_seconds(void) {
  struct timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}
#endif
