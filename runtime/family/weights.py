"""One copy of the family's weights for every session.

Each graph names its initializers as external data in the shared weight file. Left to itself,
ONNX Runtime would read that file once per session (eight copies for a four-rung family); instead
the file is mapped once, read-only, and every session is handed the same OrtValues.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.helper import tensor_dtype_to_np_dtype

_PACKED = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}


class SharedWeights:
    def __init__(self, weights_path: Path) -> None:
        self.path = Path(weights_path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")  # pages are shared with the page cache
        self._values: dict[str, ort.OrtValue] = {}

    def _value(self, tensor: onnx.TensorProto) -> ort.OrtValue:
        if tensor.name not in self._values:
            info = {e.key: e.value for e in tensor.external_data}
            offset, length = int(info.get("offset", 0)), int(info["length"])
            dtype = tensor_dtype_to_np_dtype(tensor.data_type)
            array = self._map[offset:offset + length].view(dtype).reshape(tuple(tensor.dims))
            self._values[tensor.name] = ort.OrtValue.ortvalue_from_numpy(array)
        return self._values[tensor.name]

    def attach(self, model_path: Path, options: ort.SessionOptions) -> None:
        """Hand the session every external initializer of its graph, by reference."""
        model = onnx.load(str(model_path), load_external_data=False)
        for tensor in model.graph.initializer:
            # 4-bit weights are packed two per byte: no numpy view describes them, so ORT reads those itself.
            if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.data_type not in _PACKED:
                options.add_initializer(tensor.name, self._value(tensor))


def external_bytes(model_paths) -> dict[str, int]:
    """Each external initializer any of the graphs reads, once, by name -> its bytes in the weight file: what one
    context compiled from these graphs holds (graphs of one context share their weights)."""
    out: dict[str, int] = {}
    for path in model_paths:
        for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                out[tensor.name] = int({e.key: e.value for e in tensor.external_data}["length"])
    return out
