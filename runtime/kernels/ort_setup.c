/* ORT's API table, the per-thread scratch and the op fields shared by every op of the library (ort_setup.h). */
#include "ort_setup.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "portable.h"

const OrtApi* staticlm_ort;

OrtStatus* ort_open(const OrtApiBase* base) {
  if (api == NULL) api = base->GetApi(ORT_API_NEEDED);
  if (api != NULL) return NULL;
  const OrtApi* oldest = base->GetApi(1); /* CreateStatus is entry 0 of every version */
  if (oldest == NULL) return NULL;        /* nothing to say it with: the graph then fails on an unknown op */
  char message[256];
  snprintf(message, sizeof message,
           "staticlm's kernels need ONNX Runtime's C API version %d (ONNX Runtime 1.%d or later); this is ONNX "
           "Runtime %s",
           ORT_API_NEEDED, ORT_API_NEEDED, base->GetVersionString());
  return oldest->CreateStatus(ORT_FAIL, message);
}

void* thread_scratch(int slot, size_t bytes) {
  static THREAD_LOCAL void* scratch[SCRATCH_SLOTS];
  static THREAD_LOCAL size_t capacity[SCRATCH_SLOTS];
  if (bytes > capacity[slot]) {
    void* grown = realloc(scratch[slot], bytes);
    if (grown == NULL) return NULL;
    scratch[slot] = grown;
    capacity[slot] = bytes;
  }
  return scratch[slot];
}

static void ORT_API_CALL destroy(void* kernel) { free(kernel); }
static const char* ORT_API_CALL cpu(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp* op, size_t i) {
  (void)op, (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ORT_API_CALL default_memory(const OrtCustomOp* op, size_t i) {
  (void)op, (void)i;
  return OrtMemTypeDefault;
}
static int ORT_API_CALL one(const OrtCustomOp* op) { (void)op; return 1; }
static int ORT_API_CALL end_version(const OrtCustomOp* op) { (void)op; return 1 << 30; }

void describe_op(OrtCustomOp* op, const OpCallbacks* callbacks) {
  memset(op, 0, sizeof *op);
  op->version = ORT_API_NEEDED; /* ORT reads no field added after it */
  op->GetName = callbacks->name;
  op->GetInputType = callbacks->input_type;
  op->GetInputTypeCount = callbacks->input_count;
  op->GetOutputType = callbacks->output_type;
  op->GetOutputTypeCount = callbacks->output_count;
  op->CreateKernelV2 = callbacks->create;
  op->KernelComputeV2 = callbacks->compute;
  op->GetExecutionProviderType = cpu;
  op->KernelDestroy = destroy;
  op->GetInputCharacteristic = required;
  op->GetOutputCharacteristic = required;
  op->GetInputMemoryType = default_memory;
  op->GetVariadicInputMinArity = one;
  op->GetVariadicInputHomogeneity = one;
  op->GetVariadicOutputMinArity = one;
  op->GetVariadicOutputHomogeneity = one;
  op->GetStartVersion = one;
  op->GetEndVersion = end_version;
}
