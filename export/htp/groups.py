"""A template graph calibrated and quantized one layer group at a time: peak memory is one group's weights plus the
activations at its input, not the model.

The float template is cut into layer groups at the residual stream (export/parts.py's split_graph: a group reads
`l{L}_out_residual` of the group before it, the first embeds, the last has the head). Each group in turn:
1. runs the recorded steps on the CPU EP, its first input the previous group's output on the same steps (kept in
   memory: [1, AR, hidden] a step), and takes the MinMax ranges of the tensors ONNX Runtime's quantizer calibrates;
2. is quantized by that quantizer, which reads those ranges (qdq.quantize_with_ranges), its integer boundary made
   (strip_boundary) and its weights finished and moved into the family's file by `finish`;
3. is freed; only its graph (weights referenced, not held) stays, and the groups are joined into one template.

The quantizer gives a tensor the same nodes and parameters whether it is a graph output, a graph input or neither,
under names that differ only at a group's boundary (`join`): joined, the groups are the graph one quantizer pass over
the whole template makes (tests/test_htp_groups.py compares the two).
"""
from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx

from staticlm.export.calibration.activations import needed_part, tensor_values
from staticlm.export.calibration.groups import Group, release_memory
from staticlm.runtime.family.quant_params import TensorQuant

from .qdq import (
    RangeMinMax,
    Ranges,
    qdq_config,
    quantize_with_ranges,
    signed_matmul_operands,
    strip_boundary,
    tensors_to_calibrate,
    through_data_movement,
)
from .tables import WriteTable, fill_tables, large_tables, with_stand_ins

Q_INPUT, Q_NODE, DQ_NODE = "_QuantizeLinear_Input", "_QuantizeLinear", "_DequantizeLinear"


def calibrate_group(group: Group, feeds: Iterable[dict[str, np.ndarray]], hidden: list[np.ndarray] | None,
                    names: list[str], *, fixed: Mapping[str, TensorQuant]) -> tuple[Ranges, list[np.ndarray]]:
    """The group run on each step's feeds (its residual input: hidden, one array a step from the group before):
    the widened MinMax ranges of names, and its residual output a step (empty for the last group).

    fixed: tensors whose parameters are set, not calibrated (the pinned ones, through data movement). The nodes
    only they need do not run (needed_part): the head's MatMul, whose output is the pinned logits, and with it the
    head's table, which the session would otherwise hold twice (its float32 weights and ORT's packed copy). Their
    ranges are the ones their parameters cover: the quantizer reads a pinned tensor's parameters, not its range
    (and recalibrated() leaves pinned tensors alone)."""
    wanted = {v.name for v in group.proto.graph.input} - {group.hidden_in}
    calibrated = [n for n in names if n not in fixed] + ([group.hidden_out] if group.hidden_out else [])
    part, made = needed_part(group.proto, calibrated)
    skipped = [n for n in names if n not in made]  # all fixed: every other name is needed
    names = [n for n in names if n in made]
    outputs = names + ([group.hidden_out] if group.hidden_out and group.hidden_out not in names else [])

    def own_feeds() -> Iterator[dict[str, np.ndarray]]:
        for i, f in enumerate(feeds):
            mine = {n: v for n, v in f.items() if n in wanted}
            if group.hidden_in is not None:
                mine[group.hidden_in] = hidden[i]
            yield mine

    minmax, out = RangeMinMax(names), []
    for values in tensor_values(group.path, outputs, own_feeds(), model=part):
        minmax.add(values[:len(names)])
        if group.hidden_out is not None:
            out.append(values[outputs.index(group.hidden_out)])
    return {**{n: _covered(fixed[n]) for n in skipped}, **minmax.ranges()}, out


def _covered(t: TensorQuant) -> tuple[np.ndarray, np.ndarray]:
    info = np.iinfo(np.dtype(t.dtype))
    return (np.array((info.min - t.zero_point) * t.scale, np.float32),
            np.array((info.max - t.zero_point) * t.scale, np.float32))


def group_ranges(groups: list[Group], feeds: Callable[[], Iterable[dict]], names: list[str], *,
                 fixed: Mapping[str, TensorQuant]) -> Ranges:
    """The ranges of names over the steps, the template's calibration one group at a time (the sink's); fixed: as
    calibrate_group's."""
    ranges: Ranges = {}
    hidden = None
    for group in groups:
        own = _own_names(group, names)
        got, hidden = calibrate_group(group, feeds(), hidden, own, fixed=fixed)
        ranges.update(got)
        release_memory()
    return ranges


def _own_names(group: Group, names: Iterable[str]) -> list[str]:
    g = group.proto.graph
    present = {o for n in g.node for o in n.output} | {v.name for v in g.input}
    return [n for n in names if n in present]


def quantize_groups(groups: list[Group], feeds: Callable[[], Iterable[dict]], *, order: onnx.GraphProto, work: Path,
                    quant, pinned: dict[str, TensorQuant], weight_overrides: dict[str, list[dict]], weights: Path,
                    write_table: WriteTable,
                    finish: Callable[[onnx.ModelProto, onnx.ModelProto], None]) -> tuple[onnx.ModelProto, Ranges]:
    """Each group calibrated on the steps and quantized (pinned: graph I/O parameters; finish(quantized, float group):
    its weights made final and moved out, in place; weights: the float weight file; write_table: a large table
    into the family's file, tables.py); the groups joined, and every calibrated range."""
    ranges: Ranges = {}
    quantized: list[onnx.ModelProto] = []
    hidden = None
    for k, group in enumerate(groups):
        g = group.proto.graph
        present = {i.name for i in g.initializer} | {o for n in g.node for o in n.output} | {v.name for v in g.input}
        own_pinned = {n: t for n, t in pinned.items() if n in present}
        overrides = {n: o for n, o in weight_overrides.items() if n in present}
        tables = large_tables(group.proto, overrides)  # quantized here, not by the quantizer (tables.py)
        source = group.path
        if tables:
            source = group.path.with_name(f"{group.path.stem}.stand_ins.onnx")
            onnx.save_model(with_stand_ins(group.proto, tables, weights), source)
        config = qdq_config(source, quant=quant, pinned=own_pinned, weight_overrides=overrides)
        names = tensors_to_calibrate(group.proto, config.op_types_to_quantize)
        fixed = through_data_movement(group.path, own_pinned)  # as qdq_config pins them
        got, hidden = calibrate_group(group, feeds(), hidden, names, fixed=fixed)
        ranges.update(got)
        release_memory()
        qdir = work / f"group{k}"
        qdir.mkdir()
        qpath = qdir / group.path.name
        quantize_with_ranges(source, qpath, config, got)
        proto = signed_matmul_operands(strip_boundary(onnx.load(str(qpath), load_external_data=True), own_pinned))
        fill_tables(proto, tables, weights, write_table)
        finish(proto, group.proto)
        shutil.rmtree(qdir)
        # parsed again: protobuf (upb) keeps replaced bytes in the message's arena until the message goes, so the
        # group's weights, moved to the family's file by finish, would stay in memory with its graph
        quantized.append(onnx.load_from_string(proto.SerializeToString()))
        del proto
        release_memory()
    return join(quantized, [g.hidden_out for g in groups[:-1]], order=order), ranges


def join(parts: list[onnx.ModelProto], boundaries: list[str], *, order: onnx.GraphProto) -> onnx.ModelProto:
    """The quantized groups as one graph. At a boundary X the group before ends Add -> X_QuantizeLinear_Input -> Q ->
    DQ -> X (a graph output) and the group after starts X -> Q -> DQ (a graph input): the first pair goes and the Add
    writes X, as in the whole graph. Nodes and initializers of the same name (the rope and mask inputs' DQ, shared
    constants) are kept once; they must be equal. Graph inputs and outputs in order's order (the float template)."""
    nodes: dict[str, onnx.NodeProto] = {}
    inits: dict[str, onnx.TensorProto] = {}
    for k, part in enumerate(parts):
        out = boundaries[k] if k < len(boundaries) else None
        drop = {f"{out}{Q_NODE}", f"{out}{DQ_NODE}"} if out else set()
        for node in part.graph.node:
            if node.name in drop:
                continue
            if out:
                node.output[:] = [out if o == f"{out}{Q_INPUT}" else o for o in node.output]
            if node.name in nodes:
                if nodes[node.name] != node:
                    raise ValueError(f"node {node.name} differs between layer groups")
                continue
            nodes[node.name] = node
        for init in part.graph.initializer:
            if init.name in inits and inits[init.name] != init:
                raise ValueError(f"initializer {init.name} differs between layer groups")
            inits.setdefault(init.name, init)
    first = parts[0]
    inner = set(boundaries)
    inputs: dict[str, onnx.ValueInfoProto] = {}
    outputs: dict[str, onnx.ValueInfoProto] = {}
    for part in parts:
        for v in part.graph.input:
            if v.name not in inner:
                inputs.setdefault(v.name, v)
        for v in part.graph.output:
            if v.name not in inner:
                outputs.setdefault(v.name, v)
    graph = onnx.helper.make_graph(list(nodes.values()), order.name, [inputs[v.name] for v in order.input],
                                   [outputs[v.name] for v in order.output], initializer=list(inits.values()))
    opsets = {o.domain: o for part in parts for o in part.opset_import}
    model = onnx.helper.make_model(graph, opset_imports=list(opsets.values()), producer_name=first.producer_name)
    model.ir_version = first.ir_version
    model.producer_version = first.producer_version
    return model
