"""One external weight file shared by every graph of a family."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

# 64 KiB is the mmap allocation granularity on Windows (4 KiB elsewhere); aligned
# offsets let ONNX Runtime map weights instead of reading them into its own heap.
ALIGNMENT = 64 * 1024


@dataclass(frozen=True)
class ExternalTensor:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    length: int


class WeightFileWriter:
    """Appends arrays to `path` at aligned offsets and hands out TensorProtos that point at them."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._tensors: dict[str, ExternalTensor] = {}
        self._hash = hashlib.sha256()

    def add(self, name: str, array: np.ndarray) -> ExternalTensor:
        if name in self._tensors:
            raise ValueError(f"weight {name!r} written twice")
        array = np.ascontiguousarray(array)
        return self.add_blocks(name, array.dtype, array.shape, [array])

    def add_blocks(self, name: str, dtype, shape: tuple[int, ...], blocks) -> ExternalTensor:
        """One tensor written from consecutive blocks of its rows (C order), none of it held whole: a transposed
        table a block of rows at a time."""
        if name in self._tensors:
            raise ValueError(f"weight {name!r} written twice")
        pad = (-self._file.tell()) % ALIGNMENT
        if pad:
            self._write(b"\0" * pad)
        offset = self._file.tell()
        for block in blocks:  # written from the array's own memory (tobytes would copy it)
            self._write(memoryview(np.ascontiguousarray(block, dtype=dtype).reshape(-1).view(np.uint8)))
        length = self._file.tell() - offset
        entry = ExternalTensor(name, np.dtype(dtype), tuple(shape), offset, length)
        if length != int(np.prod(shape, dtype=np.int64)) * entry.dtype.itemsize:
            raise ValueError(f"weight {name!r}: {length} bytes written for shape {shape}")
        self._tensors[name] = entry
        return entry

    def _write(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)

    def close(self) -> tuple[int, str]:
        """Returns (size in bytes, sha256 hex)."""
        size = self._file.tell()
        self._file.close()
        return size, self._hash.hexdigest()

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor_bytes(self, name: str) -> int:
        return self._tensors[name].length

    def proto(self, name: str) -> onnx.TensorProto:
        t = self._tensors[name]
        return self._external(t.name, t.dtype, t.shape, offset=t.offset, length=t.length)

    def rows_proto(self, name: str, *, start: int, num_rows: int, total_rows: int) -> onnx.TensorProto:
        """`{name}.rows{start}`: rows [start, start + num_rows) of a tensor that is total_rows rows in C order (its
        first axis, or a flat one), over the same bytes of the file."""
        t = self._tensors[name]
        row_bytes, rest = t.length // total_rows, t.shape[1:] if len(t.shape) > 1 else ()
        shape = (num_rows, *rest) if rest else (num_rows * row_bytes // t.dtype.itemsize,)
        return self._external(f"{name}.rows{start}", t.dtype, shape, offset=t.offset + start * row_bytes,
                              length=num_rows * row_bytes)

    def _external(self, name: str, dtype: np.dtype, shape: tuple[int, ...], *, offset: int,
                  length: int) -> onnx.TensorProto:
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(dtype)
        tensor.dims.extend(shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor


def inline_tensor(name: str, array: np.ndarray) -> onnx.TensorProto:
    """Small constants (shapes, split sizes) live inside each graph file."""
    return numpy_helper.from_array(np.asarray(array), name)
