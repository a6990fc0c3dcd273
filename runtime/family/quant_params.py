"""The parameters the host needs to talk to a quantized family.

A quantized graph's boundary tensors are integers: the host quantizes what it feeds (rope, mask) and
dequantizes what it reads (logits) with the parameters recorded here; KV bytes are never converted at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from staticlm.errors import UserError


class Quant(str, Enum):
    FLOAT = "float"  # no quantization (the float family)
    W8A16 = "w8a16"  # 8-bit weights (16-bit lm_head and embedding), 16-bit activations; a Q4_1 source exact
    W4A16 = "w4a16"  # 4-bit weights (16-bit lm_head and embedding), 16-bit activations; a Q4_1 source exact
    KV_ONLY = "kv"  # float weights and activations, quantized KV I/O only: isolates the KV cost


class KVBits(int, Enum):
    B16 = 16
    B8 = 8

    @property
    def dtype(self) -> str:
        return "uint16" if self is KVBits.B16 else "uint8"


class QuantParamsError(UserError, ValueError):
    """Quantization parameters that are missing or inconsistent."""


@dataclass(frozen=True)
class TensorQuant:
    """Per-tensor affine quantization: x = (q - zero_point) * scale."""

    scale: float
    zero_point: int
    dtype: str  # numpy name of the integer type

    def __post_init__(self) -> None:
        info = np.iinfo(np.dtype(self.dtype))
        if not (self.scale > 0 and np.isfinite(self.scale)):
            raise QuantParamsError(f"scale must be positive and finite, got {self.scale}")
        if not info.min <= self.zero_point <= info.max:
            raise QuantParamsError(f"zero point {self.zero_point} outside {self.dtype}")

    @classmethod
    def from_range(cls, lo: float, hi: float, dtype: str) -> TensorQuant:
        """Asymmetric parameters covering [lo, hi] (widened to hold 0 exactly, as the ORT quantizer does)."""
        info = np.iinfo(np.dtype(dtype))
        lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
        scale = max(hi - lo, 1e-4) / float(info.max - info.min)  # 1e-4: ORT's MinimumRealRange
        zero_point = int(np.clip(round(info.min - lo / scale), info.min, info.max))
        return cls(scale=float(np.float32(scale)), zero_point=zero_point, dtype=dtype)

    def quantize(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        info = np.iinfo(np.dtype(self.dtype))
        q = np.clip(np.rint(np.asarray(x, np.float32) / np.float32(self.scale)) + self.zero_point, info.min, info.max)
        if out is None:
            return q.astype(self.dtype)
        out[...] = q
        return out

    def dequantize(self, q: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return (q.astype(np.float32) - np.float32(self.zero_point)) * np.float32(self.scale)
        np.subtract(q, np.float32(self.zero_point), out=out, dtype=np.float32)
        out *= np.float32(self.scale)
        return out

    def to_dict(self) -> dict:
        return {"scale": self.scale, "zero_point": self.zero_point, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict) -> TensorQuant:
        return cls(scale=float(d["scale"]), zero_point=int(d["zero_point"]), dtype=str(d["dtype"]))


@dataclass(frozen=True)
class FamilyQuant:
    """Boundary parameters shared by every graph of a family (the KV buffer is shared, so they must be)."""

    quant: Quant
    kv: tuple[TensorQuant, ...]  # kv_tensor_index order; past input and new output share each entry
    rope: TensorQuant | None = None  # rope_cos and rope_sin (both in [-1, 1]); None: float input
    mask: TensorQuant | None = None  # attention_bias; None: float input
    logits: TensorQuant | None = None  # None: float output
    mask_value: float = -100.0  # what the host writes for masked entries before quantizing

    @property
    def kv_dtype(self) -> str:
        return self.kv[0].dtype

    @property
    def kv_pad_values(self) -> tuple[int, ...]:
        """The stored integer that dequantizes to 0 for each tensor: what padding rows must hold."""
        return tuple(t.zero_point for t in self.kv)

    def to_dict(self) -> dict:
        opt = (lambda t: None if t is None else t.to_dict())
        return {"quant": self.quant.value, "kv": [t.to_dict() for t in self.kv], "rope": opt(self.rope),
                "mask": opt(self.mask), "logits": opt(self.logits), "mask_value": self.mask_value}

    @classmethod
    def from_dict(cls, d: dict, *, num_kv_tensors: int) -> FamilyQuant:
        try:
            opt = (lambda v: None if v is None else TensorQuant.from_dict(v))
            fq = cls(quant=Quant(d["quant"]), kv=tuple(TensorQuant.from_dict(t) for t in d["kv"]),
                     rope=opt(d.get("rope")), mask=opt(d.get("mask")), logits=opt(d.get("logits")),
                     mask_value=float(d.get("mask_value", -100.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise QuantParamsError(f"bad quantization parameters: {e}") from None
        if len(fq.kv) != num_kv_tensors:
            raise QuantParamsError(f"{len(fq.kv)} KV quantization entries for {num_kv_tensors} KV tensors")
        if len({t.dtype for t in fq.kv}) != 1:
            raise QuantParamsError("KV tensors of one family must share one integer type")
        return fq
