"""GGUF access through the `gguf` package: metadata as Python values, tensors dequantized to float32."""
from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from .gguf_grids import GRID_TYPES, WeightGrid, decode_grid
from .model import ModelSourceError

DEQUANT_CHUNK_BYTES = 64 << 20  # float32 output dequantized per call (GGUFFile.tensor)


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
        out = np.empty(info.shape, np.float32)
        rows = out.reshape(-1, info.shape[-1]) if out.ndim else out.reshape(1, 1)  # [rows, cols]
        data = t.data.reshape(rows.shape[0], -1) if t.data.ndim else t.data.reshape(1, 1)  # [rows, row bytes/values]
        # gguf dequantizes a whole tensor through intermediates several times its float32 size (a 545 MB embedding
        # peaked 1.5 GB over it); a row is whole blocks, so a few rows at a time give the same values.
        step = max(1, DEQUANT_CHUNK_BYTES // max(1, rows.shape[1] * 4))
        try:
            for a in range(0, rows.shape[0], step):
                rows[a:a + step] = np.asarray(dequantize(data[a:a + step], t.tensor_type),
                                              np.float32).reshape(-1, rows.shape[1])
        except NotImplementedError:
            raise ModelSourceError(
                f"{self.path.name}: tensor {name} uses {info.qtype.name}, which cannot be dequantized") from None
        return out  # its own memory: detached from the mmap


    def drop_pages(self) -> None:
        """The mapped file's pages out of this process (MADV_DONTNEED; read again from the page cache when next
        touched): what was read stays counted in the process's memory while the file is mapped."""
        mapped = getattr(getattr(self._reader, "data", None), "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def grid(self, name: str) -> WeightGrid | None:
        """A 2-D tensor of a type with an exact grid (gguf_grids.GRID_TYPES), decoded from its raw blocks; None
        for other types (float, or a type with no exact form)."""
        t, info = self._by_name[name], self.tensors[name]
        if info.qtype not in GRID_TYPES or len(info.shape) != 2:
            return None
        return decode_grid(info.qtype, np.asarray(t.data), info.shape)


class LazyTensors(MutableMapping):
    """name -> tensor, made from the mapped file each time it is asked for: a model's tensors are never all in
    memory at once (an exporter reads one layer's, writes them, and drops them). Values set are kept as they are."""

    def __init__(self, makers: dict[str, Callable[[], Any]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str) -> Any:
        return self._makers[name]()

    def __setitem__(self, name: str, value: Any) -> None:
        self._makers[name] = lambda: value

    def __delitem__(self, name: str) -> None:
        del self._makers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def filtered(self, keep: Callable[[str], bool]) -> LazyTensors:
        """The tensors whose names keep accepts, still lazy."""
        return LazyTensors({name: make for name, make in self._makers.items() if keep(name)})


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


def peek_architecture(path: Path, *, max_keys: int = 64) -> str | None:
    """general.architecture, read from the first keys of the header without parsing the rest of the file (the
    reader parses every key, a 150k-token vocabulary included, before anything can be refused). None when it is
    not among the first max_keys keys, or the file is not a readable GGUF (GGUFFile says why)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            _version, _num_tensors, num_keys = struct.unpack("<IQQ", f.read(20))
            for _ in range(min(num_keys, max_keys)):
                key = _read_str(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == _STRING:
                    return _read_str(f)
                _skip_value(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, KeyError):
        return None
    return None


def _read_str(f) -> str:
    (size,) = struct.unpack("<Q", f.read(8))
    return f.read(size).decode("utf-8")


def _skip_value(f, kind: int) -> None:
    if kind == _STRING:
        _read_str(f)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        f.seek(_SCALAR_SIZES[kind], 1)


def _value(field) -> Any:
    value = field.contents()
    if isinstance(value, list) and value and not isinstance(value[0], (str, list)):
        return np.asarray(value)
    return value


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())
