"""GGUF access through the `gguf` package: metadata as Python values, tensors dequantized to float32."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from .model import ModelSourceError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims innermost first; this is reversed)
    qtype: GGMLQuantizationType


class GGUFFile:
    """An open GGUF file: `metadata` (key -> python value) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
            self.metadata: dict[str, Any] = {key: _value(field) for key, field in self._reader.fields.items()}
        except OSError as exc:
            raise ModelSourceError(f"cannot read GGUF file {path}: {_reason(exc)}") from None
        except Exception as exc:  # noqa: BLE001 -- the reader raises ValueError, struct/IndexError... on corrupt input
            raise ModelSourceError(f"{path} is not a valid GGUF file ({_reason(exc) or 'truncated'})") from None
        self._by_name = {t.name: t for t in self._reader.tensors}
        self.tensors = {t.name: TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                           GGMLQuantizationType(t.tensor_type)) for t in self._reader.tensors}

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to a float32 array of its numpy shape (owns its memory)."""
        t, info = self._by_name[name], self.tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelSourceError(
                f"{self.path.name}: tensor {name} uses {info.qtype.name}, which cannot be dequantized") from None
        return np.array(values, dtype=np.float32).reshape(info.shape)  # copy: detach from the mmap


def _value(field) -> Any:
    value = field.contents()
    if isinstance(value, list) and value and not isinstance(value[0], (str, list)):
        return np.asarray(value)
    return value


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())
