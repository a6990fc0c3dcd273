/* ONNX Runtime custom ops over a GGUF tensor's own blocks (domain "staticlm"), so a `--target cpu` family reads
 * the file's bytes per step instead of wider MatMulNBits containers:
 *
 *   GgufMatMul(x [.., K] float, w [N, row_bytes] uint8; ggml_type, N, K, row_group) -> [.., N] float: x . W^T, every
 *     row of x quantized to 8 bits per activation block once per call, output rows split across ORT's intra-op
 *     threads; row_group 8 (optional, default 0): w's rows stored by groups of 8 with their blocks interleaved
 *     (gguf_dot.h: the same bytes in another order; Q4_K's and Q6_K's as group blocks), N a multiple of 8;
 *   GgufGather(table [V, row_bytes] uint8, ids [..] int64; ggml_type, K) -> [.., K] float: rows dequantized as
 *     gguf does (the tied embedding reads the head's bytes).
 *
 * STATICLM_GGUF_PORTABLE=1 in the environment when a session registers the ops selects the portable dots (tests). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_dot.h"
#include "ops.h"
#include "ort_setup.h"

#define ROWS_PER_TASK 16 /* a multiple of GROUP */
_Static_assert(ROWS_PER_TASK % GROUP == 0, "tasks hold whole groups");
#define QUANTIZE_IN_PARALLEL 8 /* x's rows from which their quantizing is split over the threads too */
#define MAX_RANK 8

static OrtStatus* fail(const char* op, const char* what) {
  char message[256];
  snprintf(message, sizeof message, "%s: %s", op, what);
  return api->CreateStatus(ORT_INVALID_ARGUMENT, message);
}

typedef struct {
  BlockFormat format;
  int64_t n, k, row_bytes;
  DotFn dot;
  GroupDotFn group_dot; /* NULL: a grouped matrix's rows are copied out and dotted one by one */
  int64_t row_group;    /* 0 (rows as the file has them) or GROUP */
  int portable; /* the portable dots and activation rounding (tests compare them with the vector ones) */
} Kernel;

static OrtStatus* read_kernel(const OrtKernelInfo* info, const char* op, int with_n, Kernel* kernel) {
  int64_t type = 0, n = 0, k = 0;
  TRY(api->KernelInfoGetAttribute_int64(info, "ggml_type", &type));
  TRY(api->KernelInfoGetAttribute_int64(info, "K", &k));
  if (with_n) TRY(api->KernelInfoGetAttribute_int64(info, "N", &n));
  OrtStatus* absent = with_n ? api->KernelInfoGetAttribute_int64(info, "row_group", &kernel->row_group) : NULL;
  if (absent != NULL) { /* an optional attribute */
    api->ReleaseStatus(absent);
    kernel->row_group = 0;
  }
  if (kernel->row_group != 0 && (kernel->row_group != GROUP || n % GROUP != 0)) {
    return fail(op, "row_group must be 0, or 8 with N a multiple of 8");
  }
  if (!block_format((int)type, &kernel->format)) return fail(op, "unsupported ggml_type");
  if (k <= 0 || k % kernel->format.block_elems != 0) return fail(op, "K is not a whole number of blocks");
  const char* portable = getenv("STATICLM_GGUF_PORTABLE");
  kernel->portable = portable != NULL && portable[0] == '1';
  kernel->dot = dot_function((int)type, kernel->portable);
  kernel->group_dot = kernel->row_group ? group_dot_function((int)type, kernel->portable) : NULL;
  kernel->n = n;
  kernel->k = k;
  kernel->row_bytes = k / kernel->format.block_elems * kernel->format.block_bytes;
  return NULL;
}

typedef struct {
  size_t rank;
  int64_t dims[MAX_RANK];
  size_t count;
  void* data;
} Tensor;

static OrtStatus* read_tensor(const OrtValue* value, const char* op, Tensor* t) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  TRY(api->GetTensorTypeAndShape(value, &info));
  OrtStatus* status = api->GetDimensionsCount(info, &t->rank);
  if (status == NULL && (t->rank < 1 || t->rank > MAX_RANK)) status = fail(op, "input rank out of range");
  if (status == NULL) status = api->GetDimensions(info, t->dims, t->rank);
  if (status == NULL) status = api->GetTensorShapeElementCount(info, &t->count);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status != NULL) return status;
  return api->GetTensorMutableData((OrtValue*)value, &t->data);
}

/* The op's two inputs, read */
static OrtStatus* read_inputs(OrtKernelContext* context, const char* op, Tensor* first, Tensor* second) {
  const OrtValue *a = NULL, *b = NULL;
  TRY(api->KernelContext_GetInput(context, 0, &a));
  TRY(api->KernelContext_GetInput(context, 1, &b));
  TRY(read_tensor(a, op, first));
  return read_tensor(b, op, second);
}

/* ---- GgufMatMul ---------------------------------------------------------------------------------------------- */

typedef struct {
  const Kernel* kernel;
  const uint8_t* w;
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  const float* scaled;
  int64_t m;
  float* y;
  int failed; /* a task could not grow its scratch */
} MatMulJob;

static void matmul_task(void* data, size_t task) {
  MatMulJob* job = data;
  const Kernel* kn = job->kernel;
  const int64_t first = (int64_t)task * ROWS_PER_TASK;
  const int64_t last = first + ROWS_PER_TASK < kn->n ? first + ROWS_PER_TASK : kn->n;
  const int64_t scales = kn->k / kn->format.act_block;
  for (int64_t r0 = 0; r0 < job->m; r0 += TILE) { /* a tile of x's rows against this task's weight rows */
    const int rows = job->m - r0 < TILE ? (int)(job->m - r0) : TILE;
    ActRow a[TILE];
    for (int r = 0; r < rows; r++) {
      const int64_t row = r0 + r;
      a[r] = (ActRow){job->q + row * kn->k, job->d + row * scales, job->sums + row * (kn->k / 16),
                      job->scaled + row * (kn->k / 32)};
    }
    float* y = job->y + r0 * kn->n;
    if (!kn->row_group) {
      for (int64_t col = first; col < last; col++) kn->dot(job->w + col * kn->row_bytes, a, rows, (int)kn->k, y + col, kn->n);
      continue;
    }
    for (int64_t col = first; col < last; col += GROUP) { /* a group starts where its first row would */
      const uint8_t* group = job->w + col * kn->row_bytes;
      if (kn->group_dot != NULL) {
        kn->group_dot(group, a, rows, (int)kn->k, y + col, kn->n);
        continue;
      }
      uint8_t* row = thread_scratch(SCRATCH_ROW, (size_t)kn->row_bytes); /* one row copied out of the group */
      if (row == NULL) {
        job->failed = 1;
        return;
      }
      for (int j = 0; j < GROUP; j++) {
        for (int64_t b = 0; b < kn->row_bytes / kn->format.block_bytes; b++) {
          memcpy(row + b * kn->format.block_bytes, group + (b * GROUP + j) * kn->format.block_bytes,
                 (size_t)kn->format.block_bytes);
        }
        kn->dot(row, a, rows, (int)kn->k, y + col + j, kn->n);
      }
    }
  }
}

typedef struct {
  const Kernel* kernel;
  const float* x;
  int8_t* q;
  float* d;
  int16_t* sums;
  float* scaled;
} QuantizeJob;

static void quantize_task(void* data, size_t row) {
  const QuantizeJob* job = data;
  const Kernel* kn = job->kernel;
  const int64_t r = (int64_t)row, scales = kn->k / kn->format.act_block;
  quantize_act_row(job->x + r * kn->k, (int)kn->k, kn->format.act_block, job->q + r * kn->k, job->d + r * scales,
                   job->sums + r * (kn->k / 16), job->scaled + r * (kn->k / 32), kn->portable);
}

static OrtStatus* ORT_API_CALL matmul_compute(void* op_kernel, OrtKernelContext* context) {
  const Kernel* kn = op_kernel;
  Tensor x, w;
  TRY(read_inputs(context, "GgufMatMul", &x, &w));
  if (x.dims[x.rank - 1] != kn->k) return fail("GgufMatMul", "x's last dimension is not K");
  if ((int64_t)w.count != kn->n * kn->row_bytes) return fail("GgufMatMul", "w is not N rows of K's blocks");
  const int64_t m = (int64_t)x.count / kn->k;
  int64_t out_dims[MAX_RANK];
  memcpy(out_dims, x.dims, sizeof(int64_t) * x.rank);
  out_dims[x.rank - 1] = kn->n;
  OrtValue* yv = NULL;
  TRY(api->KernelContext_GetOutput(context, 0, out_dims, x.rank, &yv));
  float* y = NULL;
  TRY(api->GetTensorMutableData(yv, (void**)&y));
  if (m == 0 || kn->n == 0) return NULL;

  const int64_t scales = kn->k / kn->format.act_block, sums = kn->k / 16, scaled_sums = kn->k / 32;
  /* [M, K / act_block] scales, [M, K / 32] scaled sums, [M, K / 16] sums, [M, K] int8 levels */
  char* scratch = thread_scratch(SCRATCH_TASK, (size_t)(m * kn->k + m * (scales + scaled_sums) * sizeof(float) +
                                      m * sums * sizeof(int16_t)));
  if (scratch == NULL) return api->CreateStatus(ORT_FAIL, "GgufMatMul: out of memory");
  float* d = (float*)scratch;
  float* scaled = d + m * scales;
  int16_t* s = (int16_t*)(scaled + m * scaled_sums);
  int8_t* q = (int8_t*)(s + m * sums);
  QuantizeJob quantize = {kn, x.data, q, d, s, scaled};
  OrtStatus* status = NULL;
  if (m >= QUANTIZE_IN_PARALLEL) {
    status = api->KernelContext_ParallelFor(context, quantize_task, (size_t)m, 0, &quantize);
  } else {
    for (int64_t r = 0; r < m; r++) quantize_task(&quantize, (size_t)r);
  }
  if (status != NULL) return status;
  MatMulJob job = {kn, w.data, q, d, s, scaled, m, y, 0};
  const size_t tasks = (size_t)((kn->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  TRY(api->KernelContext_ParallelFor(context, matmul_task, tasks, 0, &job));
  return job.failed ? api->CreateStatus(ORT_FAIL, "GgufMatMul: out of memory") : NULL;
}

/* ---- GgufGather ---------------------------------------------------------------------------------------------- */

static OrtStatus* ORT_API_CALL gather_compute(void* op_kernel, OrtKernelContext* context) {
  const Kernel* kn = op_kernel;
  Tensor table, ids;
  TRY(read_inputs(context, "GgufGather", &table, &ids));
  if (table.rank != 2 || table.dims[1] != kn->row_bytes) return fail("GgufGather", "table is not rows of K's blocks");
  if (ids.rank >= MAX_RANK) return fail("GgufGather", "ids' rank out of range");
  int64_t out_dims[MAX_RANK];
  memcpy(out_dims, ids.dims, sizeof(int64_t) * ids.rank);
  out_dims[ids.rank] = kn->k;
  OrtValue* yv = NULL;
  TRY(api->KernelContext_GetOutput(context, 0, out_dims, ids.rank + 1, &yv));
  float* y = NULL;
  TRY(api->GetTensorMutableData(yv, (void**)&y));
  const int64_t* id = ids.data;
  const uint8_t* rows = table.data;
  for (size_t i = 0; i < ids.count; i++) {
    if (id[i] < 0 || id[i] >= table.dims[0]) return fail("GgufGather", "token id out of the table's range");
    dequantize_row(kn->format.type, rows + id[i] * kn->row_bytes, (int)kn->k, y + i * kn->k);
  }
  return NULL;
}

/* ---- the two ops' descriptions --------------------------------------------------------------------------------- */

static OrtStatus* create(const OrtKernelInfo* info, const char* op, int matmul, void** out) {
  Kernel* kernel = calloc(1, sizeof(Kernel));
  if (kernel == NULL) return api->CreateStatus(ORT_FAIL, "out of memory");
  OrtStatus* status = read_kernel(info, op, matmul, kernel);
  if (status == NULL && matmul && kernel->dot == NULL) status = fail(op, "no dot for this ggml_type");
  if (status != NULL) {
    free(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static OrtStatus* ORT_API_CALL create_matmul(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info,
                                             void** out) {
  (void)op, (void)a;
  return create(info, "GgufMatMul", 1, out);
}

static OrtStatus* ORT_API_CALL create_gather(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info,
                                             void** out) {
  (void)op, (void)a;
  return create(info, "GgufGather", 0, out);
}

static const char* ORT_API_CALL matmul_name(const OrtCustomOp* op) { (void)op; return "GgufMatMul"; }
static const char* ORT_API_CALL gather_name(const OrtCustomOp* op) { (void)op; return "GgufGather"; }
static size_t ORT_API_CALL two(const OrtCustomOp* op) { (void)op; return 2; }
static size_t ORT_API_CALL one(const OrtCustomOp* op) { (void)op; return 1; }
static ONNXTensorElementDataType ORT_API_CALL matmul_input(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
static ONNXTensorElementDataType ORT_API_CALL gather_input(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}
static ONNXTensorElementDataType ORT_API_CALL float_output(const OrtCustomOp* op, size_t i) {
  (void)op, (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

static OrtCustomOp matmul_op, gather_op;

OrtStatus* add_gguf_ops(OrtCustomOpDomain* domain) {
  static const OpCallbacks matmul = {matmul_name, matmul_input, two, float_output, one, create_matmul, matmul_compute};
  static const OpCallbacks gather = {gather_name, gather_input, two, float_output, one, create_gather, gather_compute};
  describe_op(&matmul_op, &matmul);
  describe_op(&gather_op, &gather);
  TRY(api->CustomOpDomain_Add(domain, &matmul_op));
  return api->CustomOpDomain_Add(domain, &gather_op);
}
