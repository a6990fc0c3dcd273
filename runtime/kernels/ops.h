/* The op files' entry points, each adding its ops to the library's domain (ops_register.c). */
#pragma once
#include "ort_abi.h"

OrtStatus* add_gguf_ops(OrtCustomOpDomain* domain);      /* gguf_ops.c: GgufMatMul, GgufGather */
OrtStatus* add_attention_ops(OrtCustomOpDomain* domain); /* attention_ops.c: CachedAttention, SegmentAttention */
