"""What a KV cache is asked to hold: the spec, the strategy and overflow choices, the counters."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from staticlm.errors import UserError


class Strategy(str, Enum):
    POINTER = "pointer"  # ours: 2(S-1) rows, windows move by pointer arithmetic, one compaction per S-1 tokens
    SHIFT = "shift"  # shift-left-and-append, a full window copy every token (AI Hub demo, genai's windowed cache)
    CONCAT = "concat"  # iterative allocation: a new, longer array every token (Hugging Face)
    BMC = "bmc"  # a new array with r spare rows every r tokens (Balancing Memory and Compute)
    IN_PLACE = "in_place"  # the graph appends at row `length` itself (GroupQueryAttention): no windows, no copies


class Overflow(str, Enum):
    ERROR = "error"  # ContextFull when the valid length would pass the largest window
    SLIDE = "slide"  # forget the oldest rows; positions keep counting


class ContextFull(UserError, RuntimeError):
    """The cache cannot take more tokens under the chosen overflow policy."""


@dataclass(frozen=True)
class KVSpec:
    num_tensors: int  # one per (layer, KV head, K or V)
    head_dim: int
    dtype: str  # the graph's KV element type; quantized KV is stored raw, never requantized
    max_past: int  # P of the largest graph: S_max - 1
    max_ar: int  # the most rows one step writes (the prefill/verify length)
    max_positions: int  # RoPE positions the model knows
    reserve: float = 2.0  # capacity = reserve x max_past rows per tensor
    overflow: Overflow = Overflow.ERROR
    batch: int = 1
    pad_values: tuple[float, ...] | None = None  # per tensor, what a never-written row holds (quantized KV: its
    # zero point, so padding dequantizes to 0 like the float cache's zeros); None: zeros
    # KV heads stored together: 1 (a tensor per head), or num_kv_heads for the in-place layout, where each
    # (layer, K|V) is one [B, Hkv, rows, D] buffer
    heads_per_buffer: int = 1
    min_kept: int = 0  # rows a slide keeps at least (a local class: its window and a step to rewind; layered.py)

    def __post_init__(self) -> None:
        if self.num_tensors < 1 or self.head_dim < 1 or self.max_past < 1 or self.max_ar < 1 or self.batch < 1:
            raise ValueError(f"invalid KV spec: {self}")
        if self.reserve <= 1.0:
            raise ValueError(f"the KV reserve factor must be > 1, got {self.reserve}")
        if self.pad_values is not None and len(self.pad_values) != self.num_tensors:
            raise ValueError(f"{len(self.pad_values)} pad values for {self.num_tensors} KV tensors")
        if self.heads_per_buffer < 1 or (self.heads_per_buffer > 1 and self.num_tensors % (2 * self.heads_per_buffer)):
            raise ValueError(f"{self.num_tensors} KV tensors do not group into buffers of "
                             f"{self.heads_per_buffer} heads")

    @property
    def num_buffers(self) -> int:
        return self.num_tensors // self.heads_per_buffer

    def coords(self, tensor: int) -> tuple[int, int]:
        """Tensor index (layer, head, K then V) -> (buffer, head inside it); buffers are (layer, K then V)."""
        h = self.heads_per_buffer
        if h == 1:
            return tensor, 0
        layer, rest = divmod(tensor, 2 * h)
        head, is_value = divmod(rest, 2)
        return 2 * layer + is_value, head

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def capacity(self) -> int:
        """Rows per tensor and sequence; never less than one window plus one full step."""
        return max(round(self.reserve * self.max_past), self.max_past + self.max_ar)


@dataclass
class KVStats:
    copied_rows: int = 0  # rows moved per tensor, summed over sequences and copies
    copied_bytes: int = 0  # bytes moved over all tensors
    num_compactions: int = 0  # copies made to make room (compaction, reallocation, shift)
    num_allocations: int = 0  # KV buffers allocated, the first one included
    reserved_bytes: int = 0  # bytes of KV buffers currently held
