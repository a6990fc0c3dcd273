"""One quantized graph per family, specialized to every shape of the family.

The graphs of a family are the same graph at different shapes: the same nodes with the same names, the
same weights, and a handful of int64 shape constants (Reshape targets, Split sizes) that differ. ONNX
Runtime's quantizer edits the graph in Python with linear scans per tensor (quadratic in the node count),
so quantizing each graph separately pays that cost once per shape. Quantizing one template and copying
its Q/DQ structure onto each shape takes one quantizer pass, and it gives every graph the same activation
parameters, which is also what one shared KV buffer and one set of host-side rope/mask/logits parameters
want anyway.
"""
from __future__ import annotations

import onnx

from staticlm.export.family import ExportError

INT64 = onnx.TensorProto.INT64


def _shape_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in graph.initializer if i.data_type == INT64}


def _check_same_structure(float_template: onnx.GraphProto, float_graph: onnx.GraphProto) -> None:
    """The specialization is only valid when the two float graphs differ in nothing but shapes."""
    a, b = float_template.node, float_graph.node
    same = len(a) == len(b) and all(
        x.op_type == y.op_type and list(x.input) == list(y.input) and list(x.output) == list(y.output)
        and x.attribute == y.attribute for x, y in zip(a, b))
    if not same:
        raise ExportError(f"graph {float_graph.name} is not the template graph at another shape")


def specialize(quantized_template: onnx.ModelProto, float_template: onnx.ModelProto,
               float_graph: onnx.ModelProto) -> onnx.ModelProto:
    """quantized_template (Q/DQ added, weights moved out) at float_graph's shape: its shape constants,
    its input/output dimensions; element types stay the template's (the integer boundary)."""
    _check_same_structure(float_template.graph, float_graph.graph)
    model = onnx.ModelProto()
    model.CopyFrom(quantized_template)
    g = model.graph
    consts = _shape_constants(float_graph.graph)
    template_consts = _shape_constants(float_template.graph)
    for i, init in enumerate(g.initializer):
        if init.name in template_consts and init.name in consts:
            g.initializer[i].CopyFrom(consts[init.name])
    dims = {v.name: v.type.tensor_type.shape for v in (*float_graph.graph.input, *float_graph.graph.output)}
    for v in (*g.input, *g.output):
        if v.name not in dims:
            raise ExportError(f"graph {float_graph.graph.name} has no tensor {v.name}")
        v.type.tensor_type.shape.CopyFrom(dims[v.name])
    # Intermediate shapes were the template's; ONNX Runtime infers them again at load.
    del g.value_info[:]
    g.name, g.doc_string = float_graph.graph.name, float_graph.graph.doc_string
    return model
