"""export/htp/ort_quantizer.py: ONNX Runtime's QDQ quantizer over indexed graph lookups writes exactly what
onnxruntime.quantization.quantize_static writes (the reference), on every graph a tiny w8a16 export quantizes."""
from __future__ import annotations

from pathlib import Path

import onnx
from test_htp import _export

from staticlm.export.htp import qdq
from staticlm.runtime.family.quant_params import KVBits


def _inline(path: Path) -> bytes:
    model = onnx.load(str(path), load_external_data=True)
    for tensor in model.graph.initializer:  # the side file's name and offsets are not the graph's content
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
    return model.SerializeToString()


def test_indexed_quantizer_writes_what_quantize_static_writes(tiny_hf_dir, tmp_path, monkeypatch):
    from onnxruntime.quantization import quantize_static

    indexed = qdq._quantize_static
    compared = []

    def both(float_path, out_path, config, cache):
        reference = Path(f"{out_path}.reference.onnx")
        quantize_static(str(float_path), str(reference), None, calibrate_method=config.calibrate_method,
                        quant_format=config.quant_format, activation_type=config.activation_type,
                        weight_type=config.weight_type, op_types_to_quantize=config.op_types_to_quantize,
                        nodes_to_quantize=config.nodes_to_quantize, nodes_to_exclude=config.nodes_to_exclude,
                        per_channel=config.per_channel, reduce_range=config.reduce_range,
                        use_external_data_format=True, calibration_providers=config.calibration_providers,
                        extra_options=config.extra_options, calibration_cache_path=str(cache))
        indexed(float_path, out_path, config, cache)
        compared.append(_inline(reference) == _inline(out_path))

    monkeypatch.setattr(qdq, "_quantize_static", both)
    # 8-bit KV: the uint16 -> uint8 converted activations (replace_input_of_nodes) as well as the plain ones
    _export(tiny_hf_dir, tmp_path / "family", kv_bits=KVBits.B8)
    assert compared and all(compared), compared
