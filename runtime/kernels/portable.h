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
