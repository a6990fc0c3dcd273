"""The KV-quantization-only variant: the float graph with integer KV inputs and outputs.

Weights and activations stay float; only what crosses the graph boundary through the KV buffer is
quantized, with the same per-tensor parameters the QDQ family uses, so `staticlm eval` can show the
cost of KV quantization alone. This is a boundary edit (one DequantizeLinear per past input, one
QuantizeLinear per new output), not a quantizer: nothing inside the graph changes precision.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from staticlm.runtime.family.quant_params import TensorQuant

# com.microsoft Q/DQ take 16-bit types at any opset (ai.onnx needs opset 21, which the float graph is not)
MS_DOMAIN = "com.microsoft"


def _params(graph: onnx.GraphProto, name: str, t: TensorQuant) -> tuple[str, str]:
    scale, zp = f"{name}_scale", f"{name}_zero_point"
    graph.initializer.extend([numpy_helper.from_array(np.array(t.scale, np.float32), scale),
                              numpy_helper.from_array(np.array(t.zero_point, np.dtype(t.dtype)), zp)])
    return scale, zp


def _rename_inputs(graph: onnx.GraphProto, old: str, new: str, *, skip: onnx.NodeProto | None = None) -> None:
    for node in graph.node:
        if node is not skip:
            node.input[:] = [new if i == old else i for i in node.input]


def add_kv_boundary(model: onnx.ModelProto, pinned: dict[str, TensorQuant]) -> onnx.ModelProto:
    g = model.graph
    for vi in g.input:
        if vi.name in pinned:
            t = pinned[vi.name]
            scale, zp = _params(g, vi.name, t)
            deq = f"{vi.name}_dequantized"
            _rename_inputs(g, vi.name, deq)
            g.node.insert(0, helper.make_node("DequantizeLinear", [vi.name, scale, zp], [deq],
                                              name=f"{vi.name}_DequantizeLinear", domain=MS_DOMAIN))
            vi.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    for vo in g.output:
        if vo.name in pinned:
            t = pinned[vo.name]
            scale, zp = _params(g, vo.name, t)
            flt, deq = f"{vo.name}_float", f"{vo.name}_dequantized"
            for node in g.node:
                node.output[:] = [flt if o == vo.name else o for o in node.output]
            # In-graph readers see the integers too, as the next step will: one rounding, applied once.
            _rename_inputs(g, vo.name, deq)
            g.node.extend([helper.make_node("QuantizeLinear", [flt, scale, zp], [vo.name],
                                            name=f"{vo.name}_QuantizeLinear", domain=MS_DOMAIN),
                           helper.make_node("DequantizeLinear", [vo.name, scale, zp], [deq],
                                            name=f"{vo.name}_DequantizeLinear", domain=MS_DOMAIN)])
            vo.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    # Topological order: readers of the new DQ outputs come before the DQ nodes appended at the end.
    return _toposort(model)


def _toposort(model: onnx.ModelProto) -> onnx.ModelProto:
    g = model.graph
    ready = {i.name for i in g.input} | {i.name for i in g.initializer} | {""}
    pending, ordered = list(g.node), []
    while pending:
        rest = []
        for node in pending:
            if all(i in ready for i in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError("graph has a cycle or a missing input")
        pending = rest
    del g.node[:]
    g.node.extend(ordered)
    return model
