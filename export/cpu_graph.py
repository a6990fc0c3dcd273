"""`--target cpu`: the Llama graph with MatMulNBits weights and a symbolic past length.

- Every linear layer, the lm_head included, is ORT's MatMulNBits over block-quantized weights packed by
  onnxruntime.quantization (never by hand). The tied head quantizes the embedding table along hidden, which
  is exactly GatherBlockQuantized's layout for a uint8-packed table, so the embedding gathers from the same
  bytes: the 49152 x 576 table is stored once, quantized, for both ends of the model.
- The past length is symbolic (`past_len`): one graph file per (batch, AR) serves every rung of the context
  ladder, so a family holds one session (one prepacked weight copy) per AR instead of one per context.
- RMSNorm keeps the float graph's Pow/ReduceMean pattern, which ORT fuses into SimplifiedLayerNormalization
  and SkipSimplifiedLayerNormalization (checked by tests/test_cpu_target.py in the optimized graph).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import onnx
from onnx import helper
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

from .config import ModelConfig
from .contract import KV_INPUT_ROLES, Role, kv_name
from .llama_graph import LlamaGraph, write_weights
from .weight_file import WeightFileWriter

MS_DOMAIN = "com.microsoft"
PAST_DIM = "past_len"
BIAS_DIM = "past_len_plus_ar"


class WeightBits(IntEnum):
    INT4 = 4
    INT8 = 8


@dataclass(frozen=True)
class CpuOptions:
    bits: WeightBits = WeightBits.INT4
    block_size: int = 32
    # Asymmetric (a zero point per block) measured better top-1 agreement with float on the eval text
    # for 4-bit SmolLM2 (see tests/test_cpu_target.py and the bench note); its cost is 1 byte per 2 blocks.
    symmetric: bool = False
    # 4: activations quantized to int8 per block, int8 dot products (MLAS's fastest CPU kernels on AVX2/VNNI).
    accuracy_level: int = 4

    def to_dict(self) -> dict:
        return {"format": "MatMulNBits", "bits": int(self.bits), "block_size": self.block_size,
                "symmetric": self.symmetric, "accuracy_level": self.accuracy_level}


class _FloatStash:
    """A WeightFileWriter stand-in: collects write_weights' float arrays so they can be quantized first."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = array


def write_cpu_weights(config: ModelConfig, hf: dict[str, np.ndarray], writer: WeightFileWriter,
                      options: CpuOptions) -> None:
    """Quantize once; write packed blobs, scales and zero points once, for every graph to reference.

    Names: `{w}.q` [N, K/block, blob] uint8, `{w}.scales` [N, K/block], `{w}.zp` (asymmetric only).
    """
    stash = _FloatStash()
    write_weights(config, hf, stash)  # the float layout ([in, out], fused qkv/gate_up, scale folded into Wq)
    floats = stash.arrays
    floats["head_t"] = (floats["embed"] if config.tie_word_embeddings else floats.pop("lm_head")).T  # [hidden, V]
    del floats["embed"]  # the embedding gathers from the quantized head (see module doc)
    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=options.block_size, is_symmetric=options.symmetric, bits=int(options.bits),
        accuracy_level=options.accuracy_level))
    quantized = {n for n in floats if n.endswith((".qkv", ".o", ".gate_up", ".down"))} | {"head_t"}
    for name, array in floats.items():
        if name not in quantized:
            writer.add(name, np.asarray(array, np.float32))  # norms (and biases) stay float
            continue
        packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(array, np.float32))
        writer.add(f"{name}.q", packed)
        writer.add(f"{name}.scales", scales)
        if not options.symmetric:
            writer.add(f"{name}.zp", zero_points)


class CpuLlamaGraph(LlamaGraph):
    def __init__(self, config: ModelConfig, shape, *, weights: WeightFileWriter, options: CpuOptions) -> None:
        super().__init__(config, shape, weights=weights)
        self.options = options
        self._writer = weights

    def _nbits_inputs(self, weight: str) -> list[str]:
        g = self.g
        names = [g.weight(f"{weight}.q"), g.weight(f"{weight}.scales")]
        return names + ([] if self.options.symmetric else [g.weight(f"{weight}.zp")])

    def _matmul_nbits(self, x: str, weight: str, *, k: int, n: int) -> str:
        o = self.options
        return self.g.op("MatMulNBits", x, *self._nbits_inputs(weight), domain=MS_DOMAIN, K=k, N=n,
                         bits=int(o.bits), block_size=o.block_size, accuracy_level=o.accuracy_level)

    def linear(self, x: str, weight: str) -> str:
        k, n = self._float_shape(weight)
        return self._matmul_nbits(x, weight, k=k, n=n)

    def _float_shape(self, weight: str) -> tuple[int, int]:
        c = self.c
        kind = weight.split(".", 1)[1]
        kv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        return {"qkv": (c.hidden_size, kv), "o": (c.num_heads * c.head_dim, c.hidden_size),
                "gate_up": (c.hidden_size, 2 * c.intermediate_size),
                "down": (c.intermediate_size, c.hidden_size)}[kind]

    def embed(self, ids: str) -> str:
        # The head's packed blob [V, K/block, blob] is the table [V, hidden] packed along hidden, low nibble first.
        g, c, o = self.g, self.c, self.options
        table = self._alias("head_t.q", "embed.q", (c.vocab_size, c.hidden_size * int(o.bits) // 8))
        inputs = [table, ids, g.weight("head_t.scales")]
        if not o.symmetric:
            per_byte = 8 // int(o.bits)
            blocks = -(-c.hidden_size // o.block_size)
            inputs.append(self._alias("head_t.zp", "embed.zp", (c.vocab_size, -(-blocks // per_byte))))
        return g.op("GatherBlockQuantized", *inputs, domain=MS_DOMAIN, bits=int(o.bits), block_size=o.block_size,
                    gather_axis=0, quantize_axis=1)

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
        return self._matmul_nbits(h, "head_t", k=self.c.hidden_size, n=self.c.vocab_size)

    def sequence_attention(self, layer: int, seq: int | None, q: str, k: str, v: str, bias: str) -> str:
        """The float graph's attention with the KV heads batched wherever no KV copy is involved.

        The float graph runs ~12 nodes per KV head; at decode the CPU EP's per-node cost (~2 us) then
        rivals the arithmetic. Here only the two window matmuls are per head: scores of the heads are
        concatenated (small [g AR, P] blocks, never KV), one softmax, one new-row matmul for all heads.
        """
        g, c, s = self.g, self.c, self.s
        hkv, grp, ar, d = c.num_kv_heads, c.group_size, s.ar, c.head_dim
        g.op("Split", k, g.const([1] * hkv), axis=1, outputs=[kv_name(Role.NEW_KEY, layer, h, seq) for h in range(hkv)])
        g.op("Split", v, g.const([1] * hkv), axis=1,
             outputs=[kv_name(Role.NEW_VALUE, layer, h, seq) for h in range(hkv)])
        qg = g.op("Reshape", q, g.const([1, hkv, grp * ar, d]))  # query heads of one KV head are adjacent
        q_parts = [qg] if hkv == 1 else g.op("Split", qg, g.const([1] * hkv), axis=1, num_outputs=hkv)
        s_past = [g.op("MatMul", q_parts[h], g.op("Transpose", kv_name(Role.PAST_KEY, layer, h, seq),
                                                   perm=[0, 1, 3, 2])) for h in range(hkv)]  # [1, 1, gAR, P]
        s_past = s_past[0] if hkv == 1 else g.op("Concat", *s_past, axis=1)  # [1, Hkv, gAR, P]
        s_new = g.op("MatMul", qg, g.op("Transpose", k, perm=[0, 1, 3, 2]))  # [1, Hkv, gAR, AR]
        scores = g.op("Reshape", g.op("Concat", s_past, s_new, axis=-1), g.const([1, hkv, grp, ar, -1]))
        probs = g.op("Softmax", g.op("Add", scores, bias), axis=-1)  # bias [1, 1, AR, P+AR] broadcasts
        p_past, p_new = self.split_probs(g.op("Reshape", probs, g.const([1, hkv, grp * ar, -1])))
        p_parts = [p_past] if hkv == 1 else g.op("Split", p_past, g.const([1] * hkv), axis=1, num_outputs=hkv)
        o_past = [g.op("MatMul", p_parts[h], kv_name(Role.PAST_VALUE, layer, h, seq)) for h in range(hkv)]
        o_past = o_past[0] if hkv == 1 else g.op("Concat", *o_past, axis=1)  # [1, Hkv, gAR, D]
        o = g.op("Add", o_past, g.op("MatMul", p_new, v))
        return g.op("Reshape", o, g.const([1, c.num_heads, ar, d]))  # [1, H, AR, D]

    def split_probs(self, probs: str) -> list[str]:
        # Slices from the end: AR is static, P is not, so no split size may mention P.
        g, ar = self.g, self.s.ar
        big = np.iinfo(np.int64).max
        past = g.op("Slice", probs, g.const([0]), g.const([-ar]), g.const([-1]))
        new = g.op("Slice", probs, g.const([-ar]), g.const([big]), g.const([-1]))
        return [past, new]

    def build(self, name: str) -> onnx.ModelProto:
        model = super().build(name)
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        _make_past_symbolic(model)
        return model


def _make_past_symbolic(model: onnx.ModelProto) -> None:
    """Past inputs [1, 1, P, D] -> [1, 1, past_len, D]; the bias [B, 1, AR, P+AR] -> [.., past_len_plus_ar]."""
    past_names = {r.value for r in KV_INPUT_ROLES}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith(tuple(f"{n}_" for n in past_names)):
            dims[2].dim_param = PAST_DIM
        elif value.name == Role.ATTENTION_BIAS.value:
            dims[3].dim_param = BIAS_DIM
