/* The library's entry point for ONNX Runtime (RegisterCustomOps: domain "staticlm" with every op file's ops), and
 * the record of the CPU it was compiled for, which runtime/kernels/__init__.py reads before loading it. */
#if defined(_WIN32)
#include <windows.h>
#else
#include <pthread.h>
#endif

#include "ops.h"
#include "ort_setup.h"
#include "portable.h"

/* What this build takes for granted of every CPU it runs on beyond its architecture's baseline: a compiler flag such
 * as -march=native puts such instructions anywhere, the portable code included, and a CPU without them stops on an
 * illegal instruction. The vector dots chosen at run time (AVX2, NEON dot products) are not listed: they run only
 * where the CPU has them. The names are those of Linux's /proc/cpuinfo. */
#if defined(__x86_64__) || defined(_M_X64)
#define TARGET_ARCH "x86_64"
#elif defined(__aarch64__) || defined(_M_ARM64)
#define TARGET_ARCH "aarch64"
#else
#define TARGET_ARCH "other"
#endif
#if defined(__AVX512F__)
#define REQ_AVX512F "avx512f,"
#else
#define REQ_AVX512F ""
#endif
#if defined(__AVX2__)
#define REQ_AVX2 "avx2,"
#else
#define REQ_AVX2 ""
#endif
#if defined(__FMA__)
#define REQ_FMA "fma,"
#else
#define REQ_FMA ""
#endif
#if defined(__F16C__)
#define REQ_F16C "f16c,"
#else
#define REQ_F16C ""
#endif
#if defined(__AVX__)
#define REQ_AVX "avx,"
#else
#define REQ_AVX ""
#endif
#if defined(__SSE4_2__)
#define REQ_SSE42 "sse4_2,"
#else
#define REQ_SSE42 ""
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#define REQ_DOTPROD "asimddp,"
#else
#define REQ_DOTPROD ""
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define REQ_I8MM "i8mm,"
#else
#define REQ_I8MM ""
#endif
#if defined(__ARM_FEATURE_SVE)
#define REQ_SVE "sve,"
#else
#define REQ_SVE ""
#endif
#define STR_(x) #x
#define STR(x) STR_(x)
STATICLM_EXPORT const char staticlm_kernels_target[] =
    "staticlm-kernels-target:" TARGET_ARCH ":" REQ_AVX512F REQ_AVX2 REQ_FMA REQ_F16C REQ_AVX REQ_SSE42 REQ_DOTPROD
    REQ_I8MM REQ_SVE ":api" STR(ORT_API_NEEDED) ";";

static OrtCustomOpDomain* domain;
static OrtStatus* domain_status;

static void make_domain(void) {
  domain_status = api->CreateCustomOpDomain("staticlm", &domain);
  if (domain_status == NULL) domain_status = add_gguf_ops(domain);
  if (domain_status == NULL) domain_status = add_attention_ops(domain);
}

#if defined(_WIN32)
static INIT_ONCE once = INIT_ONCE_STATIC_INIT;
static BOOL CALLBACK make_domain_once(PINIT_ONCE o, PVOID parameter, PVOID* context) {
  (void)o, (void)parameter, (void)context;
  make_domain();
  return TRUE;
}
#define MAKE_DOMAIN_ONCE() InitOnceExecuteOnce(&once, make_domain_once, NULL, NULL)
#else
static pthread_once_t once = PTHREAD_ONCE_INIT;
#define MAKE_DOMAIN_ONCE() pthread_once(&once, make_domain)
#endif

STATICLM_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  TRY(ort_open(base));
  if (api == NULL) return NULL;
  MAKE_DOMAIN_ONCE();
  if (domain_status != NULL) return api->CreateStatus(ORT_FAIL, api->GetErrorMessage(domain_status));
  return api->AddCustomOpDomain(options, domain);
}
