"""A minimal GGUF reader: metadata and dequantized tensors.

`gguf.GGUFReader` builds one numpy view per array element while parsing, which costs ~4 s on
SmolLM2's 49k tokens + 49k merges alone. Parsing the header with `struct` over an mmap takes
~0.1 s; only the dequantization kernels come from the `gguf` package.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .sources import ModelSourceError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format (little-endian). 8 = string, 9 = array are handled apart.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    """The header claims more bytes than the file has."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims innermost first; this is reversed)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: `metadata` (key -> python value) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
            raise ModelSourceError(f"cannot read GGUF file {path}: {_reason(exc)}") from None
        try:
            self._parse()
        except (_Truncated, struct.error, UnicodeDecodeError, OverflowError, ValueError, KeyError) as exc:
            raise ModelSourceError(f"{path} is not a valid GGUF file ({_reason(exc) or 'truncated'})") from None

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != _MAGIC:
            raise ValueError("bad magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", mm, self._pos)
            self._pos += 8 * n_dims
            qtype = GGMLQuantizationType(self._unpack("<I"))
            infos.append((name, dims, qtype, self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims, dtype=np.int64))
            nbytes = count // block * type_size
            offset = data_start + rel
            if offset + nbytes > len(mm):
                raise _Truncated()
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, offset, nbytes)

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._mm):
            raise _Truncated()
        text = self._mm[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype == _STRING:
                return self._strings(count)
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[etype])
            if self._pos + count * dtype.itemsize > len(self._mm):
                raise _Truncated()
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return arr.astype(bool) if etype == 7 else arr
        return self._unpack(_SCALARS[vtype])

    def _strings(self, count: int) -> list[str]:
        # The hot loop (~100k strings): local names, no method calls per element.
        mm, pos, size, out = self._mm, self._pos, len(self._mm), []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(mm, pos)
            pos += 8
            if pos + n > size:
                raise _Truncated()
            out.append(mm[pos:pos + n].decode("utf-8", errors="surrogateescape"))
            pos += n
        self._pos = pos
        return out

    # -- tensors ---------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to a float32 array of its numpy shape (owns its memory)."""
        info = self.tensors[name]
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        # Rows of bytes: the innermost dim is the only one blocks run along.
        rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)
        try:
            values = dequantize(rows, info.qtype)
        except NotImplementedError:
            raise ModelSourceError(
                f"{self.path.name}: tensor {name} uses {info.qtype.name}, which cannot be dequantized") from None
        return np.array(values, dtype=np.float32).reshape(info.shape)  # copy: detach from the mmap


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())
