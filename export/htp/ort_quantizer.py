"""ONNX Runtime's QDQ quantizer (`onnxruntime.quantization.QDQQuantizer`, a public class) over a graph whose
lookups are indexed.

quantize_static's quantizer keeps the graph in an `ONNXModel` that answers "who reads tensor t" and "which
initializer is named n" by scanning every node or initializer, once per quantized tensor: quadratic in the graph's
size (most of a 30-layer model's quantization time). IndexedModel answers the same questions from dictionaries.
quantize_with_index is quantize_static's QDQ path with a calibration cache (what qdq.py calls) and that model; its
output is byte-for-byte quantize_static's (tests/test_htp_quantizer.py compares the two).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import onnx
from onnxruntime.quantization.onnx_model import ONNXModel


class IndexedModel(ONNXModel):
    """ONNXModel whose reader and initializer lookups use indexes kept current by its own edits. Any change made
    around it (nodes or initializers added or removed directly) changes a count, and the index is rebuilt."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        self._readers: dict[str, list[onnx.NodeProto]] | None = None
        self._num_nodes = -1
        self._inits: dict[str, onnx.TensorProto] | None = None
        self._num_inits = -1

    # -- readers ------------------------------------------------------------------------------------------------
    def _reader_index(self) -> dict[str, list[onnx.NodeProto]]:
        nodes = self.model.graph.node
        if self._readers is None or self._num_nodes != len(nodes):
            self._readers = defaultdict(list)
            for node in nodes:
                self._index_node(node)
            self._num_nodes = len(nodes)
        return self._readers

    def _index_node(self, node: onnx.NodeProto) -> None:
        for name in dict.fromkeys(node.input):
            self._readers[name].append(node)

    def add_node(self, node) -> None:
        self._reader_index()
        super().add_node(node)
        self._index_node(self.model.graph.node[-1])  # the graph's own copy of node
        self._num_nodes = len(self.model.graph.node)

    def add_nodes(self, nodes_to_add) -> None:
        for node in nodes_to_add:
            self.add_node(node)

    def replace_node_input(self, node, old_input_name, new_input_name) -> None:  # the base's is static
        ONNXModel.replace_node_input(node, old_input_name, new_input_name)
        if self._readers is not None and old_input_name != new_input_name:
            if not any(n is node for n in self._readers[new_input_name]):
                self._readers[new_input_name].append(node)

    def replace_input_of_all_nodes(self, old_input_name, new_input_name) -> None:
        index = self._reader_index()
        # candidates that no longer read the tensor are skipped by the replacement itself (it matches names)
        for node in index.pop(old_input_name, []):
            self.replace_node_input(node, old_input_name, new_input_name)

    def replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set) -> None:
        index = self._reader_index()
        for node in index.get(old_input_name, []):
            if node.name in node_names_set:
                self.replace_node_input(node, old_input_name, new_input_name)

    # -- initializers -------------------------------------------------------------------------------------------
    def _init_index(self) -> dict[str, onnx.TensorProto]:
        inits = self.model.graph.initializer
        if self._inits is None or self._num_inits != len(inits):
            self._inits = {}
            for init in inits:
                self._inits.setdefault(init.name, init)  # the first of a name, as a scan finds it
            self._num_inits = len(inits)
        return self._inits

    def get_initializer(self, name):
        return self._init_index().get(name)

    def add_initializer(self, tensor) -> None:
        if tensor.name not in self._init_index():
            super().add_initializer(tensor)
            self._inits[tensor.name] = self.model.graph.initializer[-1]
            self._num_inits = len(self.model.graph.initializer)


def quantize_with_index(float_path: Path, out_path: Path, config, cache: Path) -> None:
    """quantize_static(float_path, out_path, calibration_cache_path=cache, QDQ format, external data) with config
    (a StaticQuantConfig from get_qnn_qdq_config), its quantizer over an IndexedModel."""
    from onnxruntime.quantization import QDQQuantizer, QuantFormat, load_tensors_data
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer, update_opset_version
    from onnxruntime.quantization.quantize import check_static_quant_arguments

    if config.quant_format is not QuantFormat.QDQ or not config.op_types_to_quantize:
        raise ValueError("quantize_with_index takes a QDQ config that lists the op types to quantize")
    extra = config.extra_options or {}
    if extra.get("SmoothQuant", False):
        raise ValueError("quantize_with_index does not run SmoothQuant")
    model = load_model_with_shape_infer(Path(float_path))
    model = update_opset_version(model, config.weight_type, config.activation_type,
                                 tensor_quant_overrides=extra.get("TensorQuantOverrides"),
                                 block_size=extra.get("BlockSize", 0))
    ranges = load_tensors_data(cache)
    if ranges.calibration_method != config.calibrate_method:
        raise ValueError(f"{cache} holds {ranges.calibration_method} ranges, the config asks {config.calibrate_method}")
    check_static_quant_arguments(config.quant_format, config.activation_type, config.weight_type)
    quantizer = QDQQuantizer(model, config.per_channel, config.reduce_range, config.weight_type,
                             config.activation_type, ranges, config.nodes_to_quantize or [],
                             config.nodes_to_exclude or [], config.op_types_to_quantize, extra)
    quantizer.model = IndexedModel(quantizer.model.model)
    quantizer.quantize_model()
    quantizer.model.save_model_to_file(str(out_path), True)
