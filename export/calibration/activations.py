"""What a float graph computes on the recorded steps: any intermediate tensor's values, and from the inputs of the
weights' MatMuls the Hessians X^T X that GPTQ rounds by (export/htp/gptq.py, export/gptq/calibrated.py)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper


def cpu_session(path: Path, *, prepack: bool = True):
    """A CPU EP session over the float graph at path. prepack False: MatMul weights used as the graph holds them
    (mapped from the weight file), not copied into ORT's packed layout at load: a group's float weights are in
    memory once, not twice (and not a third time while the copy is made), and a session opens in a fraction of
    the time. Its results equal the packed session's up to float rounding (another summation order)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def needed_part(model: onnx.ModelProto, wanted: Iterable[str]) -> tuple[onnx.ModelProto, set[str]]:
    """A copy of model (weights not loaded) with only the nodes the wanted tensors need and the initializers they
    read (graph inputs kept, so the same feeds fit), and the tensors it still makes; its graph outputs are those of
    model it still makes. What it computes is what model computes (tests/test_htp_groups.py: a family calibrated
    on such parts equals the family calibrated whole, byte for byte)."""
    g = model.graph
    producer = {o: k for k, n in enumerate(g.node) for o in n.output}
    kept: set[int] = set()
    stack = list(wanted)
    while stack:
        k = producer.get(stack.pop())
        if k is not None and k not in kept:
            kept.add(k)
            stack.extend(g.node[k].input)
    nodes = [n for k, n in enumerate(g.node) if k in kept]
    made = {v.name for v in g.input} | {o for n in nodes for o in n.output}
    read = {i for n in nodes for i in n.input}
    part = helper.make_graph(nodes, g.name, list(g.input), [v for v in g.output if v.name in made],
                             initializer=[i for i in g.initializer if i.name in read], value_info=list(g.value_info))
    out = helper.make_model(part, opset_imports=list(model.opset_import), producer_name=model.producer_name)
    out.ir_version = model.ir_version
    return out, made | {i.name for i in part.initializer}


def tensor_values(float_path: Path, names: list[str], feeds: Iterable[dict], *,
                  model: onnx.ModelProto | None = None) -> Iterator[list[np.ndarray]]:
    """Run the float graph with the named intermediate tensors as extra outputs; their values for each feed.
    model: the graph to run instead of float_path's own (needed_part's; saved beside float_path)."""
    import onnxruntime as ort

    if model is None:
        model = onnx.load(str(float_path), load_external_data=False)
    else:
        model = onnx.ModelProto.FromString(model.SerializeToString())  # the caller's stays as it is
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
