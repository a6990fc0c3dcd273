/* ONNX Runtime custom ops for attention over staticlm's own KV buffers (domain "staticlm"), every query row computed
 * alone by attend() (attention.h), so that greedy answers do not depend on the path a row took:
 *
 *   CachedAttention(q [B, S, H D], k, v [B, S, Hkv D], past_key, past_value [B, Hkv, C, D], seqlens_k [B] int32,
 *                   query_lengths [B] int32; num_heads, kv_num_heads, scale, window)
 *     -> out [B, S, H D], present_key, present_value [B, Hkv, C, D]
 *     GroupQueryAttention's in-place contract: present is past's buffer (bound to both, else past is copied); a
 *     sequence's query_lengths[b] new rows are written at row seqlens_k[b] + 1 - query_lengths[b] and row r sees
 *     the rows before it and itself (the last `window` of them when window > 0); rows past query_lengths[b] are
 *     padding: neither written nor attended, their output zeros.
 *   SegmentAttention(q, k, v, bias [B, 1, S, P + S], past_key, past_value [B, Hkv, P, D], prompt rows [Pp, D] per KV
 *                    head: the keys, then the values; num_heads, kv_num_heads, scale) -> out [B, S, H D]
 *     The segmented graphs' attention (runtime/family/segments.py): row r of sequence b sees the whole prompt
 *     segment, then the response rows and new rows where bias[b, 0, r] is 0, in that order, as the lane's buffer
 *     holds the same rows. New rows are rounded to the cache's type first, as the lane reads them back.
 * A name ending in F16 takes float16 KV (the cache's type); q, k, v and out are float32. */
#include <stdlib.h>
#include <string.h>

#include "attention_job.h"
#include "ops.h"
#include "ort_setup.h"

#define MAX_DIMS 8

typedef struct {
  OrtCustomOp op; /* first: ORT passes this op's address to every callback */
  const char* name;
  int segmented, half;
} AttentionOp;


typedef struct {
  int64_t dims[MAX_DIMS];
  size_t rank;
  void* data;
} Tensor;

static OrtStatus* fail(const char* what) { return api->CreateStatus(ORT_INVALID_ARGUMENT, what); }

static OrtStatus* input(OrtKernelContext* context, size_t i, Tensor* t) {
  const OrtValue* value = NULL;
  TRY(api->KernelContext_GetInput(context, i, &value));
  if (value == NULL) return fail("attention: an input is missing");
  OrtTensorTypeAndShapeInfo* info = NULL;
  TRY(api->GetTensorTypeAndShape(value, &info));
  OrtStatus* status = api->GetDimensionsCount(info, &t->rank);
  if (status == NULL && t->rank > MAX_DIMS) status = fail("attention: input rank out of range");
  if (status == NULL) status = api->GetDimensions(info, t->dims, t->rank);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status != NULL) return status;
  return api->GetTensorMutableData((OrtValue*)value, &t->data);
}

static OrtStatus* output(OrtKernelContext* context, size_t i, const Tensor* like, Tensor* t) {
  OrtValue* value = NULL;
  TRY(api->KernelContext_GetOutput(context, i, like->dims, like->rank, &value));
  memcpy(t->dims, like->dims, sizeof t->dims);
  t->rank = like->rank;
  return api->GetTensorMutableData(value, &t->data);
}


static OrtStatus* ORT_API_CALL compute(void* kernel, OrtKernelContext* context) {
  const AttentionKernel* kn = kernel;
  Tensor q, k, v, past_k, past_v, out;
  TRY(input(context, 0, &q));
  TRY(input(context, 1, &k));
  TRY(input(context, 2, &v));
  const int at = kn->segmented ? 4 : 3;
  TRY(input(context, at, &past_k));
  TRY(input(context, at + 1, &past_v));
  if (q.rank != 3 || k.rank != 3 || v.rank != 3 || past_k.rank != 4 || past_v.rank != 4) {
    return fail("attention: q, k, v must be [B, S, n D] and the caches [B, Hkv, rows, D]");
  }
  AttentionJob job = {.kn = kn, .b = q.dims[0], .s = q.dims[1], .hkv = kn->kv_num_heads, .d = past_k.dims[3],
             .elem = kn->half ? 2 : 4, .q = q.data, .k = k.data, .v = v.data};
  job.g = kn->num_heads / kn->kv_num_heads;
  if (q.dims[2] != kn->num_heads * job.d || k.dims[2] != job.hkv * job.d || v.dims[2] != job.hkv * job.d ||
      k.dims[0] != job.b || k.dims[1] != job.s || v.dims[0] != job.b || v.dims[1] != job.s ||
      past_k.dims[0] != job.b || past_k.dims[1] != job.hkv || memcmp(past_k.dims, past_v.dims, sizeof(int64_t) * 4)) {
    return fail("attention: the shapes of q, k, v and the caches disagree");
  }
  TRY(output(context, 0, &q, &out));
  job.out = out.data;
  if (!kn->segmented) {
    Tensor seqlens, lengths, present_k, present_v;
    TRY(input(context, 5, &seqlens));
    TRY(input(context, 6, &lengths));
    if (seqlens.rank != 1 || seqlens.dims[0] != job.b || lengths.rank != 1 || lengths.dims[0] != job.b) {
      return fail("CachedAttention: seqlens_k and query_lengths must be [B]");
    }
    TRY(output(context, 1, &past_k, &present_k));
    TRY(output(context, 2, &past_v, &present_v));
    job.capacity = past_k.dims[2];
    const size_t bytes = (size_t)(job.b * job.hkv * job.capacity * job.d) * job.elem;
    if (present_k.data != past_k.data) memcpy(present_k.data, past_k.data, bytes); /* not bound in place */
    if (present_v.data != past_v.data) memcpy(present_v.data, past_v.data, bytes);
    int32_t* before = thread_scratch(SCRATCH_CALL, sizeof(int32_t) * (size_t)job.b);
    if (before == NULL) return api->CreateStatus(ORT_FAIL, "CachedAttention: out of memory");
    job.num_new = lengths.data;
    for (int64_t b = 0; b < job.b; b++) {
      before[b] = ((const int32_t*)seqlens.data)[b] + 1 - job.num_new[b];
      if (job.num_new[b] < 0 || job.num_new[b] > job.s || before[b] < 0 || before[b] + job.num_new[b] > job.capacity) {
        return fail("CachedAttention: a sequence's rows do not fit its buffer");
      }
    }
    job.before = before;
    for (int64_t b = 0; b < job.b; b++) write_rows(&job, b, present_k.data, present_v.data);
    job.keys = present_k.data;
    job.values = present_v.data;
    job.num_prompt = 0;
  } else {
    Tensor bias;
    TRY(input(context, 3, &bias));
    job.past = past_k.dims[2];
    if (bias.rank != 4 || bias.dims[0] != job.b || bias.dims[2] != job.s || bias.dims[3] != job.past + job.s) {
      return fail("SegmentAttention: the bias must be [B, 1, S, P + S]");
    }
    size_t count = 0;
    TRY(api->KernelContext_GetInputCount(context, &count));
    if (count != 6 + 2 * (size_t)job.hkv) return fail("SegmentAttention: one prompt key and value per KV head");
    /* the call's own data: the prompt rows' addresses, then (half caches) the new rows as the cache will hold them */
    const size_t num_rounded = kn->half ? (size_t)(job.b * job.s * 2 * job.hkv * job.d) : 0;
    const void** prompt = thread_scratch(SCRATCH_CALL, sizeof(void*) * 2 * (size_t)job.hkv +
                                                           sizeof(uint16_t) * num_rounded);
    if (prompt == NULL) return api->CreateStatus(ORT_FAIL, "SegmentAttention: out of memory");
    job.num_prompt = -1;
    for (int64_t i = 0; i < 2 * job.hkv; i++) {
      Tensor p;
      OrtStatus* status = input(context, 6 + (size_t)i, &p);
      if (status == NULL && (p.rank != 2 || p.dims[1] != job.d || (job.num_prompt >= 0 && p.dims[0] != job.num_prompt))) {
        status = fail("SegmentAttention: the prompt rows must be [Pp, D], as many for every head");
      }
      if (status != NULL) return status;
      job.num_prompt = p.dims[0];
      prompt[i] = p.data;
    }
    job.prompt = prompt;
    job.keys = past_k.data;
    job.values = past_v.data;
    job.bias = bias.data;
    if (kn->half) {
      job.rounded = (uint16_t*)(prompt + 2 * job.hkv);
      for (int64_t i = 0; i < job.b * job.s; i++) {
        to_half(job.k + i * job.hkv * job.d, (int)(job.hkv * job.d), job.rounded + i * 2 * job.hkv * job.d);
        to_half(job.v + i * job.hkv * job.d, (int)(job.hkv * job.d), job.rounded + (i * 2 + 1) * job.hkv * job.d);
      }
    }
  }
  OrtStatus* status = api->KernelContext_ParallelFor(context, attention_task, attention_tasks(&job), 0, &job);
  if (status == NULL && job.failed) status = api->CreateStatus(ORT_FAIL, "attention: out of memory");
  return status;
}

/* ---- the ops' descriptions -------------------------------------------------------------------------------------- */

static OrtStatus* ORT_API_CALL create(const OrtCustomOp* op, const OrtApi* a, const OrtKernelInfo* info, void** out) {
  (void)a;
  const AttentionOp* self = (const AttentionOp*)op;
  AttentionKernel* kn = calloc(1, sizeof(AttentionKernel));
  if (kn == NULL) return api->CreateStatus(ORT_FAIL, "out of memory");
  kn->segmented = self->segmented;
  kn->half = self->half;
  OrtStatus* status = api->KernelInfoGetAttribute_int64(info, "num_heads", &kn->num_heads);
  if (status == NULL) status = api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &kn->kv_num_heads);
  if (status == NULL) status = api->KernelInfoGetAttribute_float(info, "scale", &kn->scale);
  if (status == NULL) {
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, "window", &kn->window);
    if (absent != NULL) { /* optional: every row */
      api->ReleaseStatus(absent);
      kn->window = 0;
    }
  }
  if (status == NULL && (kn->kv_num_heads <= 0 || kn->num_heads % kn->kv_num_heads != 0 || kn->window < 0)) {
    status = fail("attention: num_heads must be a multiple of kv_num_heads, and window at least 0");
  }
  if (status != NULL) {
    free(kn);
    return status;
  }
  *out = kn;
  return NULL;
}

static const char* ORT_API_CALL name(const OrtCustomOp* op) { return ((const AttentionOp*)op)->name; }
static size_t ORT_API_CALL input_count(const OrtCustomOp* op) { (void)op; return 7; }
static size_t ORT_API_CALL output_count(const OrtCustomOp* op) { return ((const AttentionOp*)op)->segmented ? 1 : 3; }

static ONNXTensorElementDataType kv_type(const OrtCustomOp* op) {
  return ((const AttentionOp*)op)->half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp* op, size_t i) {
  if (((const AttentionOp*)op)->segmented) return i < 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : kv_type(op);
  return i < 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : i < 5 ? kv_type(op) : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
}

static ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp* op, size_t i) {
  return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : kv_type(op);
}

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp* op, size_t i) {
  return ((const AttentionOp*)op)->segmented && i == 6 ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
}

static int ORT_API_CALL min_arity(const OrtCustomOp* op) { (void)op; return 2; }

static AttentionOp ops[4] = {{.name = "CachedAttention"}, {.name = "CachedAttentionF16", .half = 1},
                             {.name = "SegmentAttention", .segmented = 1},
                             {.name = "SegmentAttentionF16", .segmented = 1, .half = 1}};

OrtStatus* add_attention_ops(OrtCustomOpDomain* domain) {
  for (int i = 0; i < 4; i++) {
    OrtCustomOp* op = &ops[i].op;
    static const OpCallbacks callbacks = {name, input_type, input_count, output_type, output_count, create, compute};
    describe_op(op, &callbacks);
    op->GetInputCharacteristic = input_kind;
    op->GetVariadicInputMinArity = min_arity;
    TRY(api->CustomOpDomain_Add(domain, op));
  }
  return NULL;
}
