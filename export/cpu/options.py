"""The CPU target's export options: weight bits, blocks, the correction rows and the attention body."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from pathlib import Path

from staticlm.export.gptq.options import GptqOptions
from staticlm.runtime.family.contract import KVLayout


class CpuAttention(str, Enum):
    # GroupQueryAttention, KV appended in place: fewer nodes and bindings per step than `windows` (see gqa.py)
    GQA = "gqa"
    WINDOWS = "windows"  # per-head past windows + new-row outputs: the kv_manager strategies and the BMC ladder

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.IN_PLACE if self is CpuAttention.GQA else KVLayout.PER_HEAD


class GridMinima(str, Enum):
    """How a GGUF grid's per-block minima (Q4_1, Q4_K, Q5_1, Q5_K) reach MatMulNBits, whose zero points are integers."""
    EXACT = "exact"  # offsets C [K/32, N] through a float MatMul of x's block sums: every weight bit-exact
    # the nearest integer zero point, and the rest (under half a step per block) in the correction rows of quant.py,
    # rounded there to the node's bits: weights within a small fraction of a step, two small nodes per linear
    # fewer (the offsets' Reshape, ReduceSum, MatMul and Add against the rows' MatMul and Concat)
    FOLDED = "folded"


KV_DTYPES = ("float16", "float32")


def default_kv_dtype(*, staticlm_attention: bool = False) -> str:
    """float16 where staticlm's attention reads the cache (it converts rows to float32 as it reads them, which costs
    less than the bytes it saves: `staticlm bench` decodes faster at every context, with half the KV memory), or
    where the CPU computes in half precision (ARM64's FP16 extension, x86's AVX512-FP16); float32 elsewhere.

    GroupQueryAttention runs in its cache's type, and where the CPU has no half-precision arithmetic ORT converts
    every row it reads: float16 KV halves the cache's memory there but slows each step; `--kv-dtype` chooses either
    anywhere.
    """
    if staticlm_attention:
        return "float16"
    machine = platform.machine().lower()
    if machine == "arm64":  # Apple silicon: FP16 arithmetic on every core
        return "float16"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return "float16" if flags & {"asimdhp", "fphp", "avx512fp16"} else "float32"


class WeightBits(IntEnum):
    INT4 = 4
    INT8 = 8


@dataclass(frozen=True)
class CpuOptions:
    """How float weights are rounded. A GGUF tensor with an exact grid keeps its own (linears.py) whatever these say."""

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
    # The in-place KV buffers' element type (GroupQueryAttention computes in it): float16 halves KV memory and
    # the bytes a step reads where the CPU has half-precision arithmetic (default_kv_dtype)
    kv_dtype: str = field(default_factory=default_kv_dtype)
    grid_minima: GridMinima = GridMinima.EXACT  # layer linears only; the head keeps its minima exact
    # `--calib`: the float projections GPTQ-rounded on recorded calibration traces (export/gptq/), kept as grids
    # (no correction rows: GPTQ already carries each block's error onto the rest); None: nearest rounding
    gptq: GptqOptions | None = None
    calib_steps: int = 96  # recorded decoding steps, as `--target htp` records them
    # A GGUF tensor of a type staticlm's kernels read (runtime/kernels) keeps its own blocks, read by GgufMatMul and
    # GgufGather: a step reads the file's bytes. They compute in int8 like accuracy level 4; the family then needs
    # the kernels' library where it runs. `staticlm export` turns this on where the library is built.
    gguf_kernels: bool = False
    # The in-place and segmented graphs attend with staticlm's CachedAttention and SegmentAttention
    # (runtime/kernels/attention_ops.c) instead of GroupQueryAttention and MatMul/Softmax nodes: each query row is
    # computed alone, so greedy answers do not depend on the rows beside it or on the graph kind that ran it, and
    # sampled and greedy requests can share a prompt segment. Needs the kernels' library where the family runs.
    staticlm_attention: bool = False

    def __post_init__(self) -> None:
        if self.attention is CpuAttention.WINDOWS:  # the window strategies' caches are float32
            object.__setattr__(self, "kv_dtype", "float32")
            object.__setattr__(self, "staticlm_attention", False)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

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
                "accuracy_level": self.accuracy_level, "attention": self.attention.value,
                "grid_minima": self.grid_minima.value, "kv_dtype": self.kv_dtype, "gguf_kernels": self.gguf_kernels,
                "staticlm_attention": self.staticlm_attention,
                **({"gptq": self.gptq.to_dict(), "calib_steps": self.calib_steps} if self.gptq else {})}
