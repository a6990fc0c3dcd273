"""A float graph cut into layer groups at the residual stream (export/parts.py's split_graph: a group reads
`l{L}_out_residual` of the group before it, the first embeds, the last has the final norm and the head), so that one
group's weights are in memory at a time: the HTP export's trace recording (streamed.py) and its calibration and
quantization (export/htp/groups.py)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from staticlm.export.parts import split_graph

# Float weight bytes a group holds at most (a layer larger than this is a group of its own). ONNX Runtime's
# quantizer holds a group's float weights, their quantized copies and the graph's protobuf at once.
MAX_GROUP_BYTES = 512 << 20


def _float_bytes(init: onnx.TensorProto) -> int:
    return int(np.prod(init.dims, dtype=np.int64)) * 4 if init.data_type == onnx.TensorProto.FLOAT else 0


def layer_groups_within(model: onnx.ModelProto, num_layers: int, *, max_bytes: int) -> list[tuple[int, int]]:
    """Contiguous layer groups, each within max_bytes of float weights (the embedding counted with layer 0, the head
    with the last layer), greedily; a layer over max_bytes alone. max_bytes 0: one layer a group."""
    per_layer = [0] * num_layers
    for init in model.graph.initializer:
        head = init.name.split(".", 1)[0]
        layer = int(head[1:]) if head[:1] == "l" and head[1:].isdigit() else None
        per_layer[layer if layer is not None else (0 if init.name.startswith("embed") else num_layers - 1)] += \
            _float_bytes(init)
    groups, a, total = [], 0, 0
    for k, b in enumerate(per_layer):
        if k > a and total + b > max_bytes:
            groups.append((a, k))
            a, total = k, 0
        total += b
    return groups + [(a, num_layers)]


@dataclass(frozen=True)
class Group:
    path: Path  # the float group graph, beside the float weights it references
    proto: onnx.ModelProto  # without its weights
    hidden_in: str | None  # the residual it reads from the group before (None: the first group)
    hidden_out: str | None  # the residual it gives the next group (None: the last group)


def split_template(float_path: Path, *, kv_layer: dict[str, int], num_layers: int, hidden_size: int,
                   max_bytes: int = MAX_GROUP_BYTES) -> list[Group]:
    """The float template at float_path cut into layer groups, each saved beside it (group files: cleaned with the
    scratch directory)."""
    model = onnx.load(str(float_path), load_external_data=False)
    groups = layer_groups_within(model, num_layers, max_bytes=max_bytes)
    ids = next(v for v in model.graph.input if v.name == "input_ids").type.tensor_type.shape.dim
    parts = split_graph(model, groups, kv_layer=kv_layer, hidden_shape=[d.dim_value for d in ids] + [hidden_size])
    infos = {v.name: v for v in model.graph.value_info}
    out = []
    for k, part in enumerate(parts):
        produced = {o for n in part.graph.node for o in n.output}
        part.graph.value_info.extend(infos[n] for n in sorted(produced) if n in infos)  # the norms' declared types
        inputs = {v.name for v in part.graph.input}
        hidden_in = next((n for n in inputs if n.endswith("_out_residual")), None)
        hidden_out = next((v.name for v in part.graph.output if v.name.endswith("_out_residual")), None)
        path = float_path.with_name(f"{float_path.stem}.group{k}.onnx")
        onnx.save_model(part, path)
        out.append(Group(path, part, hidden_in, hidden_out))
    return out


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def release_memory() -> None:
    """After a group: its objects collected, and the C heap's free pages given back to the system (glibc's
    malloc_trim; elsewhere a no-op). Without it the heap keeps what one group's quantizer or session freed, and the
    next group's peak lands on top of it."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
