"""What a float graph computes on the recorded steps: any intermediate tensor's values, and from the inputs of the
weights' MatMuls the Hessians X^T X that GPTQ rounds by (export/htp/gptq.py, export/gptq/calibrated.py)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper


def tensor_values(float_path: Path, names: list[str], feeds: Iterable[dict]) -> Iterator[list[np.ndarray]]:
    """Run the float graph with the named intermediate tensors as extra outputs; their values for each feed."""
    import onnxruntime as ort

    model = onnx.load(str(float_path), load_external_data=False)
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    path = float_path.with_name(f"{float_path.stem}.tensors.onnx")  # next to it: weights.bin resolves
    onnx.save_model(model, path)
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    finally:
        path.unlink(missing_ok=True)  # the session holds the graph
    for f in feeds:
        yield session.run(names, f)


def weight_inputs(model: onnx.ModelProto, weights: list[str]) -> dict[str, str]:
    """weight name -> the activation it multiplies (MatMul(x, W))."""
    wanted = set(weights)
    return {n.input[1]: n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in wanted}


def hessians(float_path: Path, steps: Iterable[tuple[dict[str, np.ndarray], int]],
             inputs: list[str]) -> dict[str, np.ndarray]:
    """X^T X of each named activation over the calibration steps: (feeds, number of real rows) each. Padding
    rows (a multi-row graph running a shorter step) are left out: they repeat a real row's token."""
    num_rows: list[int] = []

    def feeds():  # lazily: a step's feeds hold its whole KV window
        for f, n in steps:
            num_rows.append(n)
            yield f

    h: dict[str, np.ndarray] = {}
    for values in tensor_values(float_path, inputs, feeds()):
        for name, x in zip(inputs, values):
            rows = x.reshape(-1, x.shape[-1])[:num_rows[-1]]  # [B=1, .., AR, K] -> [real rows, K]: real rows first
            h[name] = h[name] + rows.T @ rows if name in h else rows.T @ rows  # [K, K]: one GEMM a step
    if not h:
        raise ValueError("GPTQ read no calibration steps")
    return h
