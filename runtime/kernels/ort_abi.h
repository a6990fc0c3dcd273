/* The part of ONNX Runtime's C ABI that staticlm's ops use, declared here so that the library builds with a C
 * compiler alone: ORT's Python wheel ships no C header, and a system package with one needs root.
 *
 * ORT's ABI is append-only: OrtApi is a table of function pointers whose order never changes, and a runtime hands
 * out the table of any version up to its own (OrtApiBase.GetApi). So the table is declared up to the last entry the
 * ops call (ORT_API_NEEDED's), entries the ops do not call as unnamed slots; ort_setup.c asks for that version and
 * declines in one line where the runtime is older. tests/test_kernels_build.py compiles a check that every name
 * below sits at the same offset as in ORT's own onnxruntime_c_api.h, where that header is at hand. */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* KernelContext_ParallelFor (entry 274) came with ORT 1.17, whose API version is 17 (ORT 1.x: version x) */
#define ORT_API_NEEDED 17

#if defined(_WIN32)
#define ORT_API_CALL __stdcall /* as ORT's header: it matters on 32-bit x86 only */
#else
#define ORT_API_CALL
#endif

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtCustomOp OrtCustomOp;

typedef enum OrtErrorCode { ORT_OK, ORT_FAIL, ORT_INVALID_ARGUMENT } OrtErrorCode; /* the first of ORT's codes */

typedef enum ONNXTensorElementDataType { /* ONNX's TensorProto.DataType numbers */
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 = 6,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
} ONNXTensorElementDataType;

typedef enum OrtMemType { OrtMemTypeDefault = 0 } OrtMemType;

typedef enum OrtCustomOpInputOutputCharacteristic {
  INPUT_OUTPUT_REQUIRED = 0,
  INPUT_OUTPUT_OPTIONAL,
  INPUT_OUTPUT_VARIADIC,
} OrtCustomOpInputOutputCharacteristic;

typedef void (*OrtUnusedEntry)(void); /* a slot of the table the ops do not call: only its size counts */

/* ORT's OrtApi, entries 0 to 274 (their numbers in the comments) */
typedef struct OrtApi {
  OrtStatus*(ORT_API_CALL* CreateStatus)(OrtErrorCode code, const char* msg); /* 0 */
  OrtUnusedEntry unused_1[1];
  const char*(ORT_API_CALL* GetErrorMessage)(const OrtStatus* status); /* 2 */
  OrtUnusedEntry unused_3[23];
  OrtStatus*(ORT_API_CALL* CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out); /* 26 */
  OrtStatus*(ORT_API_CALL* CustomOpDomain_Add)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
  OrtStatus*(ORT_API_CALL* AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
  OrtUnusedEntry unused_29[22];
  OrtStatus*(ORT_API_CALL* GetTensorMutableData)(OrtValue* value, void** out); /* 51 */
  OrtUnusedEntry unused_52[9];
  OrtStatus*(ORT_API_CALL* GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out); /* 61 */
  OrtStatus*(ORT_API_CALL* GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count);
  OrtUnusedEntry unused_63[1];
  OrtStatus*(ORT_API_CALL* GetTensorShapeElementCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out); /* 64 */
  OrtStatus*(ORT_API_CALL* GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
  OrtUnusedEntry unused_66[19];
  OrtStatus*(ORT_API_CALL* KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, /* 85 */
                                                         float* out);
  OrtStatus*(ORT_API_CALL* KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out);
  OrtUnusedEntry unused_87[1];
  OrtStatus*(ORT_API_CALL* KernelContext_GetInputCount)(const OrtKernelContext* context, size_t* out); /* 88 */
  OrtUnusedEntry unused_89[1];
  OrtStatus*(ORT_API_CALL* KernelContext_GetInput)(const OrtKernelContext* context, size_t index, /* 90 */
                                                   const OrtValue** out);
  OrtStatus*(ORT_API_CALL* KernelContext_GetOutput)(OrtKernelContext* context, size_t index,
                                                    const int64_t* dims, size_t count, OrtValue** out);
  OrtUnusedEntry unused_92[1];
  void(ORT_API_CALL* ReleaseStatus)(OrtStatus* input); /* 93 */
  OrtUnusedEntry unused_94[5];
  void(ORT_API_CALL* ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* input); /* 99 */
  OrtUnusedEntry unused_100[174];
  OrtStatus*(ORT_API_CALL* KernelContext_ParallelFor)(const OrtKernelContext* context, /* 274 */
                                                      void (*fn)(void*, size_t), size_t total, size_t num_batch,
                                                      void* data);
} OrtApi;
_Static_assert(offsetof(OrtApi, KernelContext_ParallelFor) == 274 * sizeof(OrtUnusedEntry), "OrtApi's slots");

typedef struct OrtApiBase {
  const OrtApi*(ORT_API_CALL* GetApi)(uint32_t version); /* NULL: a runtime older than version */
  const char*(ORT_API_CALL* GetVersionString)(void);
} OrtApiBase;

/* ORT's OrtCustomOp: ORT reads the fields of the version an op declares in `version` and no later ones */
struct OrtCustomOp {
  uint32_t version;
  void*(ORT_API_CALL* CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char*(ORT_API_CALL* GetName)(const OrtCustomOp* op);
  const char*(ORT_API_CALL* GetExecutionProviderType)(const OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetInputType)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetOutputTypeCount)(const OrtCustomOp* op);
  void(ORT_API_CALL* KernelCompute)(void* op_kernel, OrtKernelContext* context);
  void(ORT_API_CALL* KernelDestroy)(void* op_kernel);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtMemType(ORT_API_CALL* GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int(ORT_API_CALL* GetVariadicInputMinArity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus*(ORT_API_CALL* CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                           void** kernel);
  OrtStatus*(ORT_API_CALL* KernelComputeV2)(void* op_kernel, OrtKernelContext* context);
  OrtStatus*(ORT_API_CALL* InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* context);
  int(ORT_API_CALL* GetStartVersion)(const OrtCustomOp* op);
  int(ORT_API_CALL* GetEndVersion)(const OrtCustomOp* op); /* the last field of version 17 */
};
