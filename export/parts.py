"""Layer-group graphs ("parts"): each family graph cut into N graphs over layers [a, b), written beside it.

A part takes the residual stream in and gives it out ([B, AR, hidden], Role.HIDDEN); the first part also embeds,
the last also has the final norm and the head. Parts are cut out of the family's own graphs (whatever the target:
float, cpu or the quantized htp graphs) at the tensors every builder names `l{L}_out_residual` (and, in the cpu
target's graphs, `l{L}_out_normed`, the next layer's normed input), so a part computes exactly what its layers
computed in the whole graph, reads the same weights (the one weights.bin, referenced, never copied) and binds the
same KV tensors of its layers. Two uses:
- KV-Runahead (runtime/engine/runahead.py): workers sync per layer group on the KV rows earlier workers wrote;
- a model larger than one HTP context (about 2 GB of weights per QNN context): each part is its own context.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from staticlm.errors import UserError
from staticlm.runtime.family.contract import Role, TensorSpec
from staticlm.runtime.family.manifest import (
    GraphEntry,
    GraphKind,
    LayerParts,
    Manifest,
    file_sha256,
    load_manifest,
)
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session.compile_memory import GIB, CompileEstimate, max_part_bytes

BOUNDARY_SUFFIXES = ("_out_normed", "_out_residual")  # in the order a part binds them
# what a chain runs: generation, prompt chunks and verification (not the batched segment graphs)
PART_KINDS = (GraphKind.DECODE, GraphKind.PREFILL, GraphKind.SINK)


def layer_groups(num_layers: int, num_parts: int) -> list[tuple[int, int]]:
    """[a, b) of each part: as even as the layers allow, the first parts one layer longer."""
    if not 1 <= num_parts <= num_layers:
        raise UserError(f"--parts must be in 1..{num_layers} (the model's layers), got {num_parts}")
    base, extra = divmod(num_layers, num_parts)
    out, a = [], 0
    for k in range(num_parts):
        b = a + base + (k < extra)
        out.append((a, b))
        a = b
    return out


class PartTooLarge(UserError, ValueError):
    """One layer's weights alone exceed a context."""


def weight_bytes_by_layer(family_dir: str | Path, manifest: Manifest) -> tuple[list[int], int, int]:
    """(bytes of each layer's weights, of the first part's own: the embedding, of the last part's own: final norm
    and head), from the weight file's entries the family's graphs read. A weight of no layer (a block-sum table
    that layers share) counts with every layer: a part holds one copy of it, so a group of several layers is
    overcounted, never under."""
    files = sorted({Path(family_dir) / g.file for g in manifest.graphs if g.kind in PART_KINDS})
    sizes = external_bytes(files[:1])  # every graph of the family reads the same weights (template.py)
    per_layer = [0] * manifest.model.num_layers
    first = last = shared = 0
    for name, size in sizes.items():
        layer = name[1:].split(".", 1)[0] if name.startswith("l") and "." in name else ""
        if layer.isdigit():
            per_layer[int(layer)] += size
        elif name.startswith("embed"):  # embed_quantized (the quantizer's names), or embed
            first += size
        elif name.startswith(("lm_head_t", "final_norm")):
            last += size
        else:
            shared += size
    return [b + shared for b in per_layer], first, last


@dataclass(frozen=True)
class PartSizing:
    """What `--parts auto` sizes an HTP family's parts for: the weight bytes one context holds (the SoC's), and the
    memory one part's compile may take (runtime/session/compile_memory.py)."""
    max_context_bytes: int
    compile_memory: int


def _num_context_graphs(manifest: Manifest) -> tuple[int, int]:
    """(graphs a layer part's context holds, graphs a part without layers holds: the embedding's or the head's,
    which no context length changes, so the ladder's rungs share them)."""
    entries = [g for g in manifest.graphs if g.kind in PART_KINDS]
    free = {(g.kind is GraphKind.SINK, g.shape.batch, g.shape.ar) for g in entries}
    return len({g.file for g in entries}), len(free)


def sized_groups(family_dir: str | Path, sizing: PartSizing) -> list[tuple[int, int]]:
    """The family's layer groups for --parts auto: one group when the whole family compiles within the budget and
    fits one context; otherwise the embedding and the head each a part of their own (few graphs to compile), and
    the fewest layer groups between them whose weights fit both the context and the compile budget."""
    manifest = load_manifest(family_dir)
    per_layer, first, last = weight_bytes_by_layer(family_dir, manifest)
    num_graphs, num_free = _num_context_graphs(manifest)
    layer_max = min(sizing.max_context_bytes, max_part_bytes(sizing.compile_memory, num_graphs=num_graphs))
    if sum(per_layer) + first + last <= layer_max:
        return [(0, len(per_layer))]
    end_max = min(sizing.max_context_bytes, max_part_bytes(sizing.compile_memory, num_graphs=num_free))
    for what, size in (("the embedding", first), ("the head", last)):
        if size > end_max:
            raise PartTooLarge(_too_large(what, size, num_graphs=num_free, sizing=sizing))
    if per_layer and max(per_layer) > layer_max:
        k = int(np.argmax(per_layer))
        raise PartTooLarge(_too_large(f"layer {k}", per_layer[k], num_graphs=num_graphs, sizing=sizing))
    n = len(per_layer)
    return [(0, 0), *balanced_groups(per_layer, max_bytes=layer_max), (n, n)]


def balanced_groups(per_layer: list[int], *, max_bytes: int) -> list[tuple[int, int]]:
    """As few contiguous groups as fit max_bytes (groups_by_bytes), their largest made as small as that many allow:
    no runt of a layer or two at the end, and each part's compile as far under the budget as the count lets it."""
    num_groups = len(groups_by_bytes(per_layer, first=0, last=0, max_bytes=max_bytes))
    lo, hi = max(per_layer), max_bytes  # the smallest limit that still makes num_groups groups
    while lo < hi:
        mid = (lo + hi) // 2
        if len(groups_by_bytes(per_layer, first=0, last=0, max_bytes=mid)) <= num_groups:
            hi = mid
        else:
            lo = mid + 1
    return groups_by_bytes(per_layer, first=0, last=0, max_bytes=lo)


def _too_large(what: str, size: int, *, num_graphs: int, sizing: PartSizing) -> str:
    peak = CompileEstimate(weight_bytes=size, num_graphs=num_graphs).peak_bytes
    if size > sizing.max_context_bytes:
        return (f"{what} needs {size} bytes of weights, over one context's {sizing.max_context_bytes}: no part can "
                f"hold it")
    return (f"{what} ({size} bytes of weights) alone needs about {peak / GIB:.1f} GiB to compile {num_graphs} graphs, "
            f"over --compile-memory {sizing.compile_memory / GIB:.1f} GiB: give more, or fewer graphs (--context "
            f"rungs)")


def groups_by_bytes(per_layer: list[int], *, first: int, last: int, max_bytes: int) -> list[tuple[int, int]]:
    """The fewest contiguous layer groups whose weights (the first with `first` bytes more, the last with `last`)
    each stay within max_bytes; PartTooLarge names a layer that cannot fit any part."""
    n = len(per_layer)
    own = [b + (first if k == 0 else 0) + (last if k == n - 1 else 0) for k, b in enumerate(per_layer)]
    for k, b in enumerate(own):
        if b > max_bytes:
            extra = " with the embedding" if k == 0 and first else " with the head" if k == n - 1 and last else ""
            raise PartTooLarge(f"layer {k} needs {b} bytes of weights{extra}, over one context's {max_bytes}: "
                               f"no part can hold it")
    groups, a, total = [], 0, 0
    for k, b in enumerate(own):  # greedy: the fewest parts for contiguous groups
        if k > a and total + b > max_bytes:
            groups.append((a, k))
            a, total = k, 0
        total += b
    return groups + [(a, n)]


def _embedded(graph: onnx.GraphProto) -> list[str]:
    """The embedding's rows: the output of the Gather that reads the token ids."""
    found = [n.output[0] for n in graph.node if n.op_type == "Gather" and Role.INPUT_IDS.value in n.input]
    if len(found) != 1:
        raise ValueError(f"graph {graph.name} has no single embedding Gather to cut after")
    return found


def _boundary(graph: onnx.GraphProto, layer: int, produced: set[str]) -> list[str]:
    """The residual stream after `layer` (-1: the embedding's rows)."""
    if layer < 0:
        return _embedded(graph)
    names = [f"l{layer}{suffix}" for suffix in BOUNDARY_SUFFIXES]
    found = [n for n in names if n in produced]
    if not found:
        raise ValueError(f"graph {graph.name} names no residual after layer {layer} (l{layer}_out_residual)")
    return found


def _walk(graph: onnx.GraphProto, outputs: list[str], *, stop: set[str], producers: dict[str, int]
          ) -> tuple[set[int], set[str]]:
    """Nodes that outputs need, walking back until a stop name or a graph input; and the names read there."""
    graph_inputs = {i.name for i in graph.input}
    nodes, reads, stack = set(), set(), list(outputs)
    while stack:
        name = stack.pop()
        if not name or name in reads:
            continue
        if name in stop or name in graph_inputs or name not in producers:
            reads.add(name)  # a boundary, a graph input or an initializer
            continue
        index = producers[name]
        if index not in nodes:
            nodes.add(index)
            stack.extend(graph.node[index].input)
    return nodes, reads


def split_graph(model: onnx.ModelProto, groups: list[tuple[int, int]], *, kv_layer: dict[str, int],
                hidden_shape: list[int]) -> list[onnx.ModelProto]:
    """model cut into one graph per layer group; kv_layer: each KV input/output name's layer."""
    graph = model.graph
    producers = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    boundaries = [_boundary(graph, b - 1, set(producers)) for _a, b in groups[:-1]]  # (0, 0): the embedding
    inits = {t.name: t for t in graph.initializer}
    values = {v.name: v for v in (*graph.input, *graph.output)}
    for name in (n for names in boundaries for n in names):
        values[name] = helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, hidden_shape)
    walks = []
    for k, (a, b) in enumerate(groups):
        last = k == len(groups) - 1
        own = [o.name for o in graph.output  # its layers' KV; the logits in the last part
               if (a <= kv_layer[o.name] < b if o.name in kv_layer else last)]
        outs = own + ([] if last else boundaries[k])
        walks.append((outs, *_walk(graph, outs, stop=set(boundaries[k - 1]) if k else set(), producers=producers)))
    parts = []
    for k, (outs, nodes, reads) in enumerate(walks):
        if k + 1 < len(walks):  # a boundary tensor the next part does not read is not an output
            outs = [o for o in outs if o not in boundaries[k] or o in walks[k + 1][2]]
        inputs = [n for n in (*(boundaries[k - 1] if k else ()), *(i.name for i in graph.input)) if n in reads]
        part = helper.make_graph([graph.node[i] for i in sorted(nodes)], f"{graph.name}.part{k}",
                                 [values[n] for n in inputs], [values[n] for n in outs],
                                 initializer=[inits[n] for n in sorted(reads) if n in inits])
        proto = helper.make_model(part, opset_imports=list(model.opset_import), producer_name=model.producer_name,
                                  doc_string=f"{model.doc_string} part {k}: layers [{groups[k][0]}, {groups[k][1]})")
        proto.ir_version = model.ir_version
        parts.append(proto)
    return parts


def _context_free_key(part: onnx.ModelProto, kv_layer: dict[str, int]) -> str | None:
    """A part that reads and writes no KV (the embedding's, the head's) is the same graph at every rung of the
    ladder: its content without its name, else None."""
    names = {v.name for v in (*part.graph.input, *part.graph.output)}
    if names & set(kv_layer):
        return None
    proto = onnx.ModelProto()
    proto.CopyFrom(part)
    proto.graph.name, proto.doc_string = "", ""
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def _part_specs(part: onnx.ModelProto, entry: GraphEntry, *, hidden_size: int) -> tuple[tuple, tuple]:
    by_name = {s.name: s for s in (*entry.inputs, *entry.outputs)}
    hidden = (entry.shape.batch, entry.shape.ar, hidden_size)  # [B, AR, hidden]

    def spec(name: str, pool: tuple[TensorSpec, ...]) -> TensorSpec:
        found = next((s for s in pool if s.name == name), None)
        return found or by_name.get(name) or TensorSpec(name, Role.HIDDEN, "float32", hidden)

    return (tuple(spec(v.name, entry.inputs) for v in part.graph.input),
            tuple(spec(v.name, entry.outputs) for v in part.graph.output))


def auto_groups(family_dir: str | Path, *, max_bytes: int) -> list[tuple[int, int]]:
    """The family's layer groups by weight bytes (groups_by_bytes), each part under max_bytes."""
    manifest = load_manifest(family_dir)
    per_layer, first, last = weight_bytes_by_layer(family_dir, manifest)
    return groups_by_bytes(per_layer, first=first, last=last, max_bytes=max_bytes)


def add_parts(family_dir: str | Path, num_parts: int | None = None, *,
              groups: list[tuple[int, int]] | None = None) -> Manifest:
    """Cut every graph of the family in family_dir into num_parts layer groups (or the given groups), written beside
    it, and record them in its manifest (`parts`: the layer groups and each graph's part entries)."""
    family_dir = Path(family_dir)
    manifest = load_manifest(family_dir)
    groups = groups or layer_groups(manifest.model.num_layers, num_parts)
    by_file: dict[str, list[GraphEntry]] = {}
    for entry in manifest.graphs:
        if entry.kind in PART_KINDS:
            by_file.setdefault(entry.file, []).append(entry)
    part_entries: dict[str, tuple[GraphEntry, ...]] = {}
    written: dict[str, tuple[str, str]] = {}  # a part without KV, by its content: (file, sha256)
    for file, entries in by_file.items():
        model = onnx.load(family_dir / file, load_external_data=False)
        first = entries[0]
        kv_layer = {s.name: s.layer for s in (*first.inputs, *first.outputs) if s.layer is not None}
        # [B, AR, hidden], B and AR symbolic where the graph's are (one in-place file serves every shape)
        ids = next(v for v in model.graph.input if v.name == Role.INPUT_IDS.value).type.tensor_type.shape.dim
        hidden_shape = [d.dim_param or d.dim_value for d in ids] + [manifest.model.hidden_size]
        stem = Path(file).stem
        files = []
        for k, part in enumerate(split_graph(model, groups, kv_layer=kv_layer, hidden_shape=hidden_shape)):
            key = _context_free_key(part, kv_layer)
            if key in written:  # the same graph at another rung: one file, one graph to compile
                files.append((*written[key], part))
                continue
            part_file = f"{stem}.part{k}.onnx"
            onnx.save_model(part, family_dir / part_file)
            files.append((part_file, file_sha256(family_dir / part_file), part))
            if key is not None:
                written[key] = files[-1][:2]
        for entry in entries:
            chain = []
            for k, (part_file, sha, part) in enumerate(files):
                inputs, outputs = _part_specs(part, entry, hidden_size=manifest.model.hidden_size)
                chain.append(GraphEntry(name=f"{entry.name}.part{k}", file=part_file, kind=entry.kind,
                                        shape=entry.shape, inputs=inputs, outputs=outputs, sha256=sha))
            part_entries[entry.name] = tuple(chain)
    manifest = dataclasses.replace(manifest, parts=LayerParts(layers=tuple(groups), graphs=part_entries))
    manifest.save(family_dir)
    return manifest
