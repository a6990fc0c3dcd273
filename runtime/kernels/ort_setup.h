/* What every op file of the kernels library shares: ONNX Runtime's API table once it is opened, the error
 * shorthand, the per-thread scratch (scratch.h), and the fields every op's description has alike. ops_register.c
 * opens the table and registers the ops; the op files (gguf_ops.c, attention_ops.c) only use it. */
#pragma once
#include "ort_abi.h"
#include "scratch.h"

extern const OrtApi* staticlm_ort; /* set by ort_open() before any op exists */
#define api staticlm_ort

#define TRY(expr)                          \
  do {                                     \
    OrtStatus* status_ = (expr);           \
    if (status_ != NULL) return status_;   \
  } while (0)

/* Opens ORT's table at ORT_API_NEEDED: NULL, or why not (a status made through the oldest table, which every
 * runtime has: "needs C API version 17, this ONNX Runtime 1.x has ..."). */
OrtStatus* ort_open(const OrtApiBase* base);

/* What tells one op from another: its name, inputs and outputs, and its kernel */
typedef struct {
  const char*(ORT_API_CALL* name)(const OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* input_type)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* input_count)(const OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* output_type)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* output_count)(const OrtCustomOp* op);
  OrtStatus*(ORT_API_CALL* create)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus*(ORT_API_CALL* compute)(void* kernel, OrtKernelContext* context);
} OpCallbacks;

/* op described by its callbacks, and the fields every op here fills alike: ORT's CPU provider, ORT_API_NEEDED's
 * fields only, required inputs and outputs in default memory, the kernel freed with free(), opset 1 on (an op with a
 * variadic input sets GetInputCharacteristic and GetVariadicInputMinArity after). */
void describe_op(OrtCustomOp* op, const OpCallbacks* callbacks);
