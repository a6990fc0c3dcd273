"""`--target cpu`: the Llama graph with MatMulNBits weights and a symbolic past length.

- Every linear layer, the lm_head included, is ORT's MatMulNBits: a GGUF source's own grid kept exactly, or a
  float weight rounded by onnxruntime.quantization (linears.py, weights.py). The tied head's table is the
  embedding quantized along hidden, which is exactly GatherBlockQuantized's layout for a uint8-packed table, so
  the embedding gathers from the same bytes: the table is stored once, quantized, for both ends of the model.
- Attention (CpuAttention): by default ORT's GroupQueryAttention over KV buffers it updates in place
  (gqa.py, KVLayout.IN_PLACE); `windows` keeps the float family's per-head past windows and new-row outputs
  (attention.py), which the kv_manager's four strategies and the BMC ladder manage.
- The KV length is symbolic (`past_len`, `kv_rows`): one graph file per (batch, AR) serves every context, so a
  family holds one session (one prepacked weight copy) per AR instead of one per context.
- Both bodies use ORT's fused CPU contrib ops and few nodes per layer (checked by tests/test_cpu_target.py in
  the exported and the ORT-optimized graph).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from staticlm.export.graph.llama import LlamaGraph
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import KV_INPUT_ROLES, Role, graph_io, in_place_graph_io, kv_name
from staticlm.runtime.kernels import DOMAIN as KERNEL_DOMAIN

from .attention import RopeTables, grouped_bias
from .attention import attention as windows_attention
from .gqa import attention as gqa_attention
from .linear_parts import FLOAT_BITS, MatMulPart
from .linears import OFFSET_BLOCK, LinearPlan, node_weights
from .options import CpuAttention, CpuOptions, WeightBits
from .quant import block_sum_matrix, correction_rows
from .rope import PositionRope
from .weights import EMBED, HEAD, write_cpu_weights

__all__ = ["CpuAttention", "CpuLlamaGraph", "CpuOptions", "WeightBits", "write_cpu_weights"]
MS_DOMAIN = "com.microsoft"
PAST_DIM = "past_len"
BIAS_DIM = "past_len_plus_ar"
LOCAL_PAST_DIM, LOCAL_BIAS_DIM, LOCAL_ROWS_DIM = "local_past_len", "local_past_len_plus_ar", "local_kv_rows"
ROWS_DIM = "kv_rows"
BATCH_DIM, AR_DIM, SCORED_DIM, LOGIT_ROWS_DIM = "batch", "ar", "scored_rows", "logit_rows"


class CpuLlamaGraph(LlamaGraph):
    def __init__(self, config: ModelConfig, shape, *, weights: WeightFileWriter, options: CpuOptions,
                 plans: dict[str, LinearPlan], last_logits_only: bool = False) -> None:
        super().__init__(config, shape, weights=weights)
        self.options, self.plans = options, plans  # plans: weights.write_cpu_weights' linears
        self.last_logits_only = last_logits_only  # in-place prompt graphs: see in_place_graph_io
        self._writer = weights
        self._split_sizes: dict[bool, str] = {}  # [P, AR] for split_probs (by local or not), built on first use
        self._ropes: dict[bool, RopeTables] = {}  # the windows body's RoPE inputs (by local or not), on first use
        self._position_ropes: dict[bool, PositionRope] = {}  # the in-place bodies' RoPE (by local or not), likewise
        self._biases: dict[bool, str] = {}  # and its grouped masks

    # -- the decoder layer's plug-ins (export/graph/llama.py's LlamaGraph.decoder) ------------------------------
    def rms_norm(self, x: str, weight: str) -> str:
        """ORT's SimplifiedLayerNormalization: one node."""
        return self.g.op("SimplifiedLayerNormalization", x, self.g.weight(weight), axis=-1,
                         epsilon=float(self.c.rms_norm_eps))

    def add_norm(self, x: str, residual: str, weight: str, *, tag: str) -> tuple[str, str]:
        """(RMSNorm(x + residual) * weight, x + residual) as one SkipSimplifiedLayerNormalization, whose 4th output
        is the sum, so no Add node exists for either residual connection; the unused mean/inv_std outputs are left
        out. Named {tag}_normed and {tag}_residual (export/parts.py cuts at both)."""
        normed, total = f"{tag}_normed", f"{tag}_residual"
        self.g.op("SkipSimplifiedLayerNormalization", x, residual, self.g.weight(weight), domain=MS_DOMAIN,
                  epsilon=float(self.c.rms_norm_eps), outputs=[normed, "", "", total])
        return normed, total

    def activation(self, x: str) -> str:
        """ORT's FastGelu is GELU's tanh approximation; SiLU's Mul(x, Sigmoid(x)) ORT fuses into QuickGelu."""
        if self.c.mlp_activation == "gelu_tanh":
            return self.g.op("FastGelu", x, domain=MS_DOMAIN)
        return super().activation(x)

    def layer_attention(self, layer: int, x: str) -> str:
        if self.options.attention is CpuAttention.GQA:
            return gqa_attention(self, layer, x)
        local = self.c.is_local(layer)
        return windows_attention(self, layer, x, rope=self.rope_tables(local=local),
                                 bias=self.grouped_bias(local=local))

    def rope_tables(self, *, local: bool = False) -> RopeTables:
        """The RoPE inputs every layer of the kind (local or not) reads, made once per graph."""
        if local not in self._ropes:
            self._ropes[local] = RopeTables(self, local=local)
        return self._ropes[local]

    def position_rope(self, *, local: bool = False) -> PositionRope:
        """The RoPE of position_ids every layer of the kind (local or not) reads, made once per graph."""
        if local not in self._position_ropes:
            self._position_ropes[local] = PositionRope(self.g, self.c, local=local)
        return self._position_ropes[local]

    def grouped_bias(self, *, local: bool = False) -> str:
        if local not in self._biases:
            self._biases[local] = grouped_bias(self, local=local)
        return self._biases[local]

    def _matmul_nbits(self, x: str, part: MatMulPart, *, k: int) -> str:
        g = self.g
        if part.ggml_type is not None:  # the source's own blocks (runtime/kernels)
            grouping = {"row_group": part.row_group} if part.row_group else {}
            return g.op("GgufMatMul", x, g.weight(f"{part.weight}.gguf"), domain=KERNEL_DOMAIN,
                        ggml_type=part.ggml_type, N=part.n, K=k, **grouping)
        if part.bits == FLOAT_BITS:  # x [.., K] . W [N, K]^T, read in place
            return g.op("FusedMatMul", x, g.weight(f"{part.weight}.w"), domain=MS_DOMAIN, transB=1, alpha=1.0)
        if not part.node_rows:
            return self._matmul_rows(x, part, [g.weight(name) for name in node_weights(part)], k=k, n=part.n)
        outs, start = [], 0
        for rows in part.node_rows:  # row ranges of one stored weight (linears.node_rows), outputs side by side
            inputs = [self._rows_alias(name, start=start, num_rows=rows, total_rows=part.n)
                      for name in node_weights(part)]
            outs.append(self._matmul_rows(x, part, inputs, k=k, n=rows))
            start += rows
        return g.op("Concat", *outs, axis=-1)

    def _matmul_rows(self, x: str, part: MatMulPart, inputs: list[str], *, k: int, n: int) -> str:
        return self.g.op("MatMulNBits", x, *inputs, domain=MS_DOMAIN, K=k, N=n, bits=part.bits, block_size=part.block,
                         accuracy_level=self.options.accuracy_level)

    def _rows_alias(self, stored: str, *, start: int, num_rows: int, total_rows: int) -> str:
        """Rows [start, start + num_rows) of a stored weight, over its bytes in the weight file (no copy)."""
        proto = self._writer.rows_proto(stored, start=start, num_rows=num_rows, total_rows=total_rows)
        self.g.initializers.setdefault(proto.name, proto)
        return proto.name

    def linear(self, x: str, weight: str) -> str:
        """x [.., K] @ W: one MatMulNBits per part (linears.py), their outputs concatenated, plus the source
        grid's block offsets S(x) C, S(x) [.., K/32] the sums of x over each block of 32."""
        g, plan = self.g, self.plans[weight]
        corrected_x = None
        outs = []
        for part in plan.parts:
            if part.corrected:  # x -> [x, block sums of x] for the correction rows (quant.py)
                if corrected_x is None:
                    sums = g.op("MatMul", x, g.const(block_sum_matrix(plan.k, part.block), np.float32))
                    corrected_x = g.op("Concat", x, sums, axis=-1)
                outs.append(self._matmul_nbits(corrected_x, part, k=plan.k + correction_rows(plan.k, part.block)))
            else:
                outs.append(self._matmul_nbits(x, part, k=plan.k))
        y = outs[0] if len(outs) == 1 else g.op("Concat", *outs, axis=-1)
        if plan.offsets is None:
            return y
        return g.op("Add", y, g.op("MatMul", self._block_sums(x, k=plan.k, rank=2 if weight == HEAD else 3),
                                   g.weight(plan.offsets)))

    def _block_sums(self, x: str, *, k: int, rank: int) -> str:
        """x [.., K] -> [.., K/32]: a Reshape (no copy) and a ReduceSum."""
        g, blocks = self.g, k // OFFSET_BLOCK
        blocked = g.op("Reshape", x, g.const([0] * (rank - 1) + [blocks, OFFSET_BLOCK]))
        return g.op("ReduceSum", blocked, g.const([-1]), keepdims=0)

    def embed(self, ids: str) -> str:
        """Rows of the head's table (tied) or the embedding's own, read by GatherBlockQuantized from the packed
        bytes [V, K/block, blob] viewed as [V, hidden bits/8] (no copy), plus the block offsets of a grid type
        with minima."""
        g, c = self.g, self.c
        plan = self.plans[EMBED]
        (part,) = plan.parts
        if part.ggml_type is not None:  # rows dequantized from the source's own blocks, as gguf does
            return g.op("GgufGather", g.weight(f"{part.weight}.gguf"), ids, domain=KERNEL_DOMAIN,
                        ggml_type=part.ggml_type, K=c.hidden_size)
        if part.bits == FLOAT_BITS:
            return g.op("Gather", g.weight(f"{part.weight}.w"), ids, axis=0)
        table = self._alias(f"{part.weight}.q", f"{part.weight}.table", (c.vocab_size, c.hidden_size * part.bits // 8))
        inputs = [table, ids, g.weight(f"{part.weight}.scales")]
        if part.zero_points:
            zp = self._writer.proto(f"{part.weight}.zp")
            inputs.append(self._alias(f"{part.weight}.zp", f"{part.weight}.zp_rows", (c.vocab_size, zp.dims[-1])))
        rows = g.op("GatherBlockQuantized", *inputs, domain=MS_DOMAIN, bits=part.bits, block_size=part.block,
                    gather_axis=0, quantize_axis=1)  # [B, AR, hidden]
        if plan.offsets is None:
            return rows
        blocks = c.hidden_size // OFFSET_BLOCK
        offsets = g.op("Transpose", g.op("Gather", g.weight(plan.offsets), ids, axis=1), perm=[1, 2, 0])  # [B, AR, nb]
        rows = g.op("Reshape", rows, g.const([0, 0, blocks, OFFSET_BLOCK]))
        rows = g.op("Add", rows, g.op("Unsqueeze", offsets, g.const([-1])))
        return g.op("Reshape", rows, g.const([0, 0, c.hidden_size]))

    def _alias(self, stored: str, alias: str, shape: tuple[int, ...]) -> str:
        """Another name and shape over the same bytes of the weight file (no copy)."""
        if alias not in self.g.initializers:
            proto = self._writer.proto(stored)
            proto.name = alias
            del proto.dims[:]
            proto.dims.extend(shape)
            self.g.initializers[alias] = proto
        return alias

    def lm_head(self, h: str) -> str:
        return self.linear(h, HEAD)

    def split_probs(self, probs: str, layer: int = 0) -> list[str]:
        """[.., P + AR] -> [.., P], [.., AR]: one Split per layer; P is symbolic, so its size is read once
        per graph from a past input's shape (Shape, Slice, Concat) instead of two Slices per layer (a local layer's
        P from a local layer's past input)."""
        g, local = self.g, self.c.is_local(layer)
        if local not in self._split_sizes:
            first = next(i for i in range(self.c.num_layers) if self.c.is_local(i) == local)
            past = kv_name(Role.PAST_KEY, first, 0, None if self.s.batch == 1 else 0)
            p = g.op("Slice", g.op("Shape", past), g.const([2]), g.const([3]))  # [1]: P
            self._split_sizes[local] = g.op("Concat", p, g.const([self.s.ar]), axis=0)
        return g.op("Split", probs, self._split_sizes[local], axis=-1, num_outputs=2)

    def build(self, name: str) -> onnx.ModelProto:
        g, c, s = self.g, self.c, self.s
        gqa = self.options.attention is CpuAttention.GQA
        if self.last_logits_only and not gqa:
            raise ValueError("last-row logits need the in-place layout (its query_seqlens input)")
        inputs, outputs = (in_place_graph_io(c, s, last_logits_only=self.last_logits_only,
                                             kv_dtype=self.options.kv_dtype) if gqa else graph_io(c, s))
        h = self.decoder(self.scale_embedding(self.embed(Role.INPUT_IDS.value)))  # [B, AR, hidden], final-normed
        h = g.op("Reshape", h, g.const([-1, c.hidden_size]))  # [B AR, hidden]
        if gqa:  # the rows the caller asks for: [B R, hidden] (R = 1 for a prompt chunk, AR to verify)
            h = g.op("Gather", h, Role.LOGITS_INDEX.value, axis=0)
            batch = g.op("Slice", g.op("Shape", Role.INPUT_IDS.value), g.const([0]), g.const([1]))  # [1]: B
            logits_shape = g.op("Concat", batch, g.const([-1, c.vocab_size]), axis=0)  # [B, R, V]
        else:
            logits_shape = g.const([s.batch, s.ar, c.vocab_size])
        g.op("Reshape", self.lm_head(h), logits_shape, outputs=[Role.LOGITS.value])
        doc = "any batch and rows" if gqa else f"AR={s.ar}"
        model = g.model(name=name, inputs=inputs, outputs=outputs,
                        doc=f"staticlm {name} (cpu): {doc}, P<={s.past_len}, S={s.context}")
        add_opsets(model)
        (_make_rows_symbolic if gqa else _make_past_symbolic)(model, c)
        return model


def add_opsets(model: onnx.ModelProto) -> None:
    """ORT's contrib ops, and staticlm's kernels where the graph reads GGUF blocks."""
    model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    if any(node.domain == KERNEL_DOMAIN for node in model.graph.node):
        model.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, 1))


def rows_alone(plans: dict[str, LinearPlan], options: CpuOptions) -> bool:
    """Whether every op computes each row alone: staticlm's attention, and every linear read from GGUF blocks by
    GgufMatMul (MatMulNBits' one-row kernel rounds otherwise than its several-row one)."""
    return options.staticlm_attention and options.attention is CpuAttention.GQA and all(
        p.ggml_type is not None for plan in plans.values() for p in plan.parts)


def custom_ops(plans: dict[str, LinearPlan], options: CpuOptions) -> tuple[str, ...]:
    """The manifest's custom_ops: the kernels' domain where some linear reads GGUF blocks or staticlm attends."""
    blocks = any(p.ggml_type is not None for plan in plans.values() for p in plan.parts)
    return (KERNEL_DOMAIN,) if blocks or options.staticlm_attention else ()


def _make_rows_symbolic(model: onnx.ModelProto, config: ModelConfig) -> None:
    """Batch, rows and buffer capacity symbolic: one file serves every (batch, AR) shape. In-place buffers
    [B, Hkv, C, D] -> [batch, Hkv, kv_rows, D]: the kv_manager chooses C (a local layer's buffers: local_kv_rows,
    their own count)."""
    buffers = tuple(f"{r.value}_" for r in (Role.PAST_KEY, Role.PAST_VALUE, Role.PRESENT_KEY, Role.PRESENT_VALUE))
    step_rows = {Role.INPUT_IDS.value, Role.POSITION_IDS.value}  # [B, AR]
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith(buffers):
            local = config.is_local(int(value.name.rsplit("_", 1)[1]))  # past_key_{layer}
            dims[0].dim_param, dims[2].dim_param = BATCH_DIM, LOCAL_ROWS_DIM if local else ROWS_DIM
        elif value.name in step_rows:
            dims[0].dim_param, dims[1].dim_param = BATCH_DIM, AR_DIM
        elif value.name == Role.LOGITS_INDEX.value:
            dims[0].dim_param = SCORED_DIM
        elif value.name == Role.LOGITS.value:
            dims[0].dim_param, dims[1].dim_param = BATCH_DIM, LOGIT_ROWS_DIM
        elif len(dims) == 1:  # seqlens_k, query_seqlens [B]
            dims[0].dim_param = BATCH_DIM


def _make_past_symbolic(model: onnx.ModelProto, config: ModelConfig) -> None:
    """Past inputs [1, 1, P, D] -> [1, 1, past_len, D]; the bias [B, 1, AR, P+AR] -> [.., past_len_plus_ar]; a
    local layer's past and the local bias: local_past_len (min(P, W-1)) and local_past_len_plus_ar."""
    past_names = {r.value for r in KV_INPUT_ROLES}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith(tuple(f"{n}_" for n in past_names)):  # past_key_{layer}_h{h}[_s{seq}]
            local = config.is_local(int(value.name.split("_")[2]))
            dims[2].dim_param = LOCAL_PAST_DIM if local else PAST_DIM
        elif value.name == Role.ATTENTION_BIAS.value:
            dims[3].dim_param = BIAS_DIM
        elif value.name == Role.ATTENTION_BIAS_LOCAL.value:
            dims[3].dim_param = LOCAL_BIAS_DIM
