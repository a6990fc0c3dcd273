"""The embedding and the head quantized outside ONNX Runtime's quantizer, a block of rows at a time.

The quantizer holds a weight in float32 several times over while it quantizes it (its protobuf, a numpy copy,
the flattened copy, the temporaries of the division and rounding): for a 3B model's 1.2 GB embedding that alone
is several GB, the peak of a layer group (groups.py). The quantizer sets a 16-bit table's parameters from the
table's range only: per tensor its minimum and maximum, per column (axis 1) each column's. So it is handed a
two-row stand-in holding exactly those ranges, sets the same scales and zero points, and the whole table is then
quantized here with its own function (quant_utils.quantize_nparray) on those parameters, block by block, straight
into the family's weight file (tests/test_htp_groups.py checks the result against the quantizer's own).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

MIN_TABLE_BYTES = 64 << 20  # float tables at least this large take the stand-in
BLOCK_ROWS = 64
QUANTIZED = "_quantized"  # the quantizer's names: {w}_quantized, {w}_scale, {w}_zero_point


@dataclass(frozen=True)
class Table:
    name: str
    shape: tuple[int, ...]  # [rows, columns]
    offset: int  # in the float weight file
    per_column: bool  # parameters per column (axis 1), else per tensor

    def rows(self, weights: Path) -> Iterator[np.ndarray]:
        """[BLOCK_ROWS, columns] float32 blocks of the table, read from the weight file (read, not mapped: a mapped
        table's pages would stay in the process until the last block, the whole table by then)."""
        num_rows, num_columns = self.shape
        with open(weights, "rb") as f:
            f.seek(self.offset)
            for a in range(0, num_rows, BLOCK_ROWS):
                block = np.empty((min(BLOCK_ROWS, num_rows - a), num_columns), np.float32)
                if f.readinto(memoryview(block).cast("B")) != block.nbytes:
                    raise ValueError(f"{weights}: the table {self.name} ends early")
                yield block


def large_tables(model: onnx.ModelProto, overrides: dict[str, list[dict]], *,
                 min_bytes: int | None = None) -> list[Table]:
    """The 16-bit [rows, columns] float weights of model of at least min_bytes (per tensor or per column)."""
    from onnxruntime.quantization import QuantType

    min_bytes = MIN_TABLE_BYTES if min_bytes is None else min_bytes
    out = []
    for init in model.graph.initializer:
        over = overrides.get(init.name, [{}])[0]
        sixteen_bit = over.get("quant_type") in (QuantType.QInt16, QuantType.QUInt16) and over.get("axis") in (None, 1)
        large = len(init.dims) == 2 and 4 * init.dims[0] * init.dims[1] >= min_bytes
        if not (sixteen_bit and large and init.data_type == onnx.TensorProto.FLOAT
                and init.data_location == onnx.TensorProto.EXTERNAL):
            continue
        info = {e.key: e.value for e in init.external_data}
        out.append(Table(init.name, tuple(init.dims), int(info.get("offset", 0)), over.get("axis") == 1))
    return out


def stand_in(table: Table, weights: Path) -> onnx.TensorProto:
    """[2, columns]: the table's minimum and maximum, per column or over all of it."""
    lo = np.full(table.shape[1], np.inf, np.float32)
    hi = np.full(table.shape[1], -np.inf, np.float32)
    for block in table.rows(weights):
        np.minimum(lo, block.min(axis=0), out=lo)
        np.maximum(hi, block.max(axis=0), out=hi)
    if not table.per_column:
        lo, hi = np.full_like(lo, lo.min()), np.full_like(hi, hi.max())
    return numpy_helper.from_array(np.stack([lo, hi]), table.name)


def with_stand_ins(model: onnx.ModelProto, tables: list[Table], weights: Path) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {t.name: t for t in tables}
    for i, init in enumerate(out.graph.initializer):
        if init.name in by_name:
            out.graph.initializer[i].CopyFrom(stand_in(by_name[init.name], weights))
    return out


WriteTable = Callable[[str, np.dtype, tuple[int, ...], Iterator[np.ndarray], str], onnx.TensorProto]


def fill_tables(model: onnx.ModelProto, tables: list[Table], weights: Path, write: WriteTable) -> None:
    """In place: each stand-in's quantized two rows replaced by the whole table, quantized on the parameters the
    quantizer set (write(name, dtype, shape, blocks, key) puts it in the family's file; key: its parameters)."""
    from onnxruntime.quantization.quant_utils import quantize_nparray

    inits = {i.name: i for i in model.graph.initializer}
    for table in tables:
        q = inits[table.name + QUANTIZED]
        scale = numpy_helper.to_array(inits[f"{table.name}_scale"])
        zero = numpy_helper.to_array(inits[f"{table.name}_zero_point"])
        dtype = numpy_helper.to_array(q).dtype
        blocks = (quantize_nparray(q.data_type, block, scale, zero) for block in table.rows(weights))
        key = hashlib.sha256(scale.tobytes() + zero.tobytes()).hexdigest()
        q.CopyFrom(write(q.name, dtype, table.shape, blocks, key))
