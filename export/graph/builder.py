"""A thin node-appending helper over onnx.helper, so model code reads like math."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from staticlm.export.weight_file import WeightFileWriter, inline_tensor
from staticlm.runtime.family.contract import TensorSpec

OPSET = 17


class GraphBuilder:
    def __init__(self, *, weights: WeightFileWriter, prefix: str = "", opset: int = OPSET) -> None:
        self.weights = weights
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}
        self.prefix = prefix

    def _fresh(self, hint: str) -> str:
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        return f"{self.prefix}{hint}_{n}"

    def op(self, op_type: str, *inputs: str, num_outputs: int = 1, outputs: list[str] | None = None,
           domain: str = "", name: str | None = None, **attrs) -> str | list[str]:
        outs = outputs or [self._fresh(f"{name or op_type}_out") for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self._fresh(name or op_type),
                                           domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 and outputs is None and num_outputs == 1 else outs

    def weight(self, name: str) -> str:
        """Reference a tensor of the shared weight file (written once by the caller)."""
        if name not in self.initializers:
            self.initializers[name] = self.weights.proto(name)
        return name

    def const(self, value, dtype=np.int64) -> str:
        """An inline constant. Equal float constants share one initializer; int64 ones (Reshape targets, Split
        sizes) never do: two that are equal at one shape may differ at another (with one KV head, [B, AR, Hkv, D]
        equals [B, AR, 1, D]), and the graphs of a family must name the same constants at every shape
        (htp/template.py copies a quantized template's structure onto each shape by name)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if array.dtype == np.int64:
            key = (*key, len(self.initializers))  # unique: a new initializer per call
        if key not in self._consts:
            name = self._fresh("const")
            self.initializers[name] = inline_tensor(name, array)
            self._consts[key] = name
        return self._consts[key]

    def model(self, *, name: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
              doc: str = "") -> onnx.ModelProto:
        def info(spec: TensorSpec) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(
                spec.name, helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype)), list(spec.shape))

        graph = helper.make_graph(self.nodes, name, [info(s) for s in inputs], [info(s) for s in outputs],
                                  initializer=list(self.initializers.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="staticlm", doc_string=doc)
        model.ir_version = 9
        return model
