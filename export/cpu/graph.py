"""`--target cpu`: the Llama graph with MatMulNBits weights and a symbolic past length.

- Every linear layer, the lm_head included, is ORT's MatMulNBits over block-quantized weights packed by
  onnxruntime.quantization (never by hand). The tied head quantizes the embedding table along hidden, which
  is exactly GatherBlockQuantized's layout for a uint8-packed table, so the embedding gathers from the same
  bytes: the 49152 x 576 table is stored once, quantized, for both ends of the model.
- Attention (CpuAttention): by default ORT's GroupQueryAttention over KV buffers it updates in place
  (gqa.py, KVLayout.IN_PLACE); `windows` keeps the float family's per-head past windows and new-row outputs
  (attention.py), which the kv_manager's four strategies and the BMC ladder manage.
- The KV length is symbolic (`past_len`, `kv_rows`): one graph file per (batch, AR) serves every context, so a
  family holds one session (one prepacked weight copy) per AR instead of one per context.
- Both bodies use ORT's fused CPU contrib ops and few nodes per layer (checked by tests/test_cpu_target.py in
  the exported and the ORT-optimized graph).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum

import numpy as np
import onnx
from onnx import TensorProto, helper

from staticlm.export.graph.llama import LlamaGraph, write_weights
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import KV_INPUT_ROLES, KVLayout, Role, graph_io, in_place_graph_io, kv_name

from .attention import decoder as windows_decoder
from .gqa import ROPE_COS, ROPE_SIN, rope_tables
from .gqa import decoder as gqa_decoder
from .quant import BlockQuantizer, block_sum_matrix, correction_rows

MS_DOMAIN = "com.microsoft"
QUANTIZED_SUFFIXES = (".qkv", ".o", ".gate_up", ".down", "head_t")
PAST_DIM = "past_len"
BIAS_DIM = "past_len_plus_ar"
ROWS_DIM = "kv_rows"


class CpuAttention(str, Enum):
    # GroupQueryAttention, KV appended in place: fewer nodes and bindings per step than `windows` (see gqa.py)
    GQA = "gqa"
    WINDOWS = "windows"  # per-head past windows + new-row outputs: the kv_manager strategies and the BMC ladder

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.IN_PLACE if self is CpuAttention.GQA else KVLayout.PER_HEAD


class WeightBits(IntEnum):
    INT4 = 4
    INT8 = 8


@dataclass(frozen=True)
class CpuOptions:
    bits: WeightBits = WeightBits.INT4
    # The head/embedding table (a fifth of SmolLM2's weights; its GGUF source is 8-bit Q8_0) keeps 8 bits by
    # default: at 4 bits it costs much of the top-1 agreement with float (`staticlm eval`, apps/data/eval_en.txt).
    head_bits: WeightBits = WeightBits.INT8
    block_size: int = 32
    # Asymmetric, because SmolLM2's GGUF layers are asymmetric Q4_1: symmetric blocks lose much of the top-1
    # agreement with float (both corrected, 8-bit head), though they decode faster.
    symmetric: bool = False
    # The head's GGUF source (Q8_0) is symmetric: a symmetric head agrees as well as an asymmetric one, for less CPU.
    head_symmetric: bool = True
    # 4: activations quantized to int8 per block, int8 dot products: faster than float compute (0/1) for M=1
    # on AVX2, at the same agreement (the weights' rounding dominates the error).
    accuracy_level: int = 4

    # Extra K rows undoing each block's mean rounding error (quant.py): without them SmolLM2's 4-bit layers lose
    # much of their top-1 agreement with float (see
    # tests/test_cpu_target.py::test_smollm2_int4_top1_agrees_with_float_on_the_eval_text).
    block_correction: bool = True
    # Which layer linears carry them (kinds of `l{i}.{kind}`); each costs a MatMul and a Concat per layer.
    # All four are worth it: leaving any kind out saves little decode time and loses top-1 agreement with float
    # (`down` the most).
    corrected: frozenset[str] = frozenset({"qkv", "o", "gate_up", "down"})
    attention: CpuAttention = CpuAttention.GQA

    def corrects(self, weight: str, k: int) -> bool:
        """Whether layer weight `l{i}.{kind}` with K inputs carries correction rows (they must start a new block)."""
        kind = weight.split(".", 1)[-1]
        return self.block_correction and kind in self.corrected and k % self.block_size == 0

    @property
    def head(self) -> WeightBits:
        return max(self.head_bits, self.bits)  # --weight-bits 8 means 8 everywhere

    def validate(self, hidden_size: int) -> None:
        if hidden_size % self.block_size:  # the embedding reads the head's rows as whole blocks
            raise ValueError(f"block size {self.block_size} does not divide the hidden size {hidden_size}")

    def to_dict(self) -> dict:
        return {"format": "MatMulNBits", "bits": int(self.bits), "head_bits": int(self.head),
                "block_size": self.block_size, "block_correction": self.block_correction,
                "corrected": sorted(self.corrected) if self.block_correction else [],
                "symmetric": self.symmetric, "head_symmetric": self.head_symmetric,
                "accuracy_level": self.accuracy_level, "attention": self.attention.value}

    def is_symmetric(self, weight: str) -> bool:
        return self.head_symmetric if weight == "head_t" else self.symmetric


class _FloatStash:
    """A WeightFileWriter stand-in: collects write_weights' float arrays so they can be quantized first."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = array


def write_cpu_weights(config: ModelConfig, hf: dict[str, np.ndarray], writer: WeightFileWriter,
                      options: CpuOptions) -> None:
    """Quantize once; write packed blobs, scales and zero points once, for every graph to reference.

    Names: `{w}.q` [N, K'/block, blob] uint8, `{w}.scales` [N, K'/block], `{w}.zp` (asymmetric weights only);
    K' = K + correction_rows(K) for layer weights with the block-mean correction (quant.py), else K.
    """
    options.validate(config.hidden_size)
    stash = _FloatStash()
    write_weights(config, hf, stash)  # the float layout ([in, out], fused qkv/gate_up, scale folded into Wq)
    floats = stash.arrays
    floats["head_t"] = (floats["embed"] if config.tie_word_embeddings else floats.pop("lm_head")).T  # [hidden, V]
    del floats["embed"]  # the embedding gathers from the quantized head (see module doc)

    def quantizer(name: str) -> BlockQuantizer:
        bits = options.head if name == "head_t" else options.bits
        return BlockQuantizer(bits=int(bits), block_size=options.block_size, symmetric=options.is_symmetric(name),
                              accuracy_level=options.accuracy_level)

    for name, array in floats.items():
        if not name.endswith(QUANTIZED_SUFFIXES):
            writer.add(name, np.asarray(array, np.float32))  # norms (and biases) stay float
            continue
        quant = quantizer(name)
        if name != "head_t" and options.corrects(name, array.shape[0]):
            array = quant.corrected(array)  # [K + correction_rows, N]
        packed, scales, zero_points = quant.quantize(array)
        writer.add(f"{name}.q", packed)
        writer.add(f"{name}.scales", scales)
        if zero_points is not None:
            writer.add(f"{name}.zp", zero_points)
    if options.attention is CpuAttention.GQA:  # [max_positions, D/2], shared by every graph and layer
        cos, sin = rope_tables(head_dim=config.head_dim, theta=config.rope_theta, max_positions=config.max_positions)
        writer.add(ROPE_COS, cos)
        writer.add(ROPE_SIN, sin)


class CpuLlamaGraph(LlamaGraph):
    def __init__(self, config: ModelConfig, shape, *, weights: WeightFileWriter, options: CpuOptions,
                 last_logits_only: bool = False) -> None:
        super().__init__(config, shape, weights=weights)
        self.options = options
        self.last_logits_only = last_logits_only  # in-place prompt graphs: see in_place_graph_io
        self._writer = weights
        self._split_sizes: str | None = None  # [P, AR] for split_probs, built on first use

    def _nbits_inputs(self, weight: str) -> list[str]:
        g = self.g
        names = [g.weight(f"{weight}.q"), g.weight(f"{weight}.scales")]
        return names + ([] if self.options.is_symmetric(weight) else [g.weight(f"{weight}.zp")])

    def _matmul_nbits(self, x: str, weight: str, *, k: int, n: int) -> str:
        o = self.options
        bits = o.head if weight == "head_t" else o.bits
        return self.g.op("MatMulNBits", x, *self._nbits_inputs(weight), domain=MS_DOMAIN, K=k, N=n,
                         bits=int(bits), block_size=o.block_size, accuracy_level=o.accuracy_level)

    def linear(self, x: str, weight: str) -> str:
        k, n = self._float_shape(weight)
        if self.options.corrects(weight, k):  # x -> [x, block sums of x] for the correction rows
            block = self.options.block_size
            sums = self.g.op("MatMul", x, self.g.const(block_sum_matrix(k, block), np.float32))  # [.., K/block]
            x = self.g.op("Concat", x, sums, axis=-1)
            k += correction_rows(k, block)
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
        bits = int(o.head)
        table = self._alias("head_t.q", "embed.q", (c.vocab_size, c.hidden_size * bits // 8))
        inputs = [table, ids, g.weight("head_t.scales")]
        if not o.is_symmetric("head_t"):
            per_byte = 8 // bits
            blocks = -(-c.hidden_size // o.block_size)
            inputs.append(self._alias("head_t.zp", "embed.zp", (c.vocab_size, -(-blocks // per_byte))))
        return g.op("GatherBlockQuantized", *inputs, domain=MS_DOMAIN, bits=bits, block_size=o.block_size,
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

    def split_probs(self, probs: str) -> list[str]:
        """[.., P + AR] -> [.., P], [.., AR]: one Split per layer; P is symbolic, so its size is read once
        per graph from a past input's shape (Shape, Slice, Concat) instead of two Slices per layer."""
        g = self.g
        if self._split_sizes is None:
            past = kv_name(Role.PAST_KEY, 0, 0, None if self.s.batch == 1 else 0)
            p = g.op("Slice", g.op("Shape", past), g.const([2]), g.const([3]))  # [1]: P
            self._split_sizes = g.op("Concat", p, g.const([self.s.ar]), axis=0)
        return g.op("Split", probs, self._split_sizes, axis=-1, num_outputs=2)

    def build(self, name: str) -> onnx.ModelProto:
        g, c, s = self.g, self.c, self.s
        gqa = self.options.attention is CpuAttention.GQA
        if self.last_logits_only and not gqa:
            raise ValueError("last-row logits need the in-place layout (its query_seqlens input)")
        inputs, outputs = (in_place_graph_io(c, s, last_logits_only=self.last_logits_only) if gqa
                           else graph_io(c, s))
        h = (gqa_decoder if gqa else windows_decoder)(self, self.embed(Role.INPUT_IDS.value))  # [B, AR, hidden]
        h = g.op("Reshape", h, g.const([s.batch * s.ar, c.hidden_size]))  # [B AR, hidden]
        rows = s.ar
        if self.last_logits_only:  # row b AR + query_seqlens[b] - 1 of each sequence b
            last = g.op("Sub", g.op("Cast", Role.QUERY_LENGTHS.value, to=TensorProto.INT64), g.const([1], np.int64))
            h = g.op("Gather", h, g.op("Add", last, g.const(np.arange(s.batch) * s.ar, np.int64)), axis=0)
            rows = 1
        g.op("Reshape", self.lm_head(h), g.const([s.batch, rows, c.vocab_size]), outputs=[Role.LOGITS.value])
        model = g.model(name=name, inputs=inputs, outputs=outputs,
                        doc=f"staticlm {name} (cpu): AR={s.ar}, P<={s.past_len}, S={s.context}")
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        (_make_rows_symbolic if gqa else _make_past_symbolic)(model)
        return model


def _make_rows_symbolic(model: onnx.ModelProto) -> None:
    """In-place buffers [B, Hkv, C, D] -> [B, Hkv, kv_rows, D]: the kv_manager chooses C."""
    for value in (*model.graph.input, *model.graph.output):
        if value.name.startswith(tuple(f"{r.value}_" for r in (Role.PAST_KEY, Role.PAST_VALUE, Role.PRESENT_KEY,
                                                                  Role.PRESENT_VALUE))):
            value.type.tensor_type.shape.dim[2].dim_param = ROWS_DIM


def _make_past_symbolic(model: onnx.ModelProto) -> None:
    """Past inputs [1, 1, P, D] -> [1, 1, past_len, D]; the bias [B, 1, AR, P+AR] -> [.., past_len_plus_ar]."""
    past_names = {r.value for r in KV_INPUT_ROLES}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith(tuple(f"{n}_" for n in past_names)):
            dims[2].dim_param = PAST_DIM
        elif value.name == Role.ATTENTION_BIAS.value:
            dims[3].dim_param = BIAS_DIM
