"""One QDQ graph from one float graph, with ONNX Runtime's QNN tooling, then integer boundaries.

`get_qnn_qdq_config` + `quantize` do all the quantizing. Tensor overrides pin every boundary tensor to
family-wide parameters (each past/new KV pair to one scale and zero-point), because the KV buffer is
shared by every graph. The quantizer never changes graph I/O types, so `strip_boundary` then removes the
boundary QuantizeLinear/DequantizeLinear: inputs and outputs become the integers themselves.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from staticlm.export.calibration.activations import tensor_values
from staticlm.runtime.family.contract import KV_INPUT_ROLES, KV_OUTPUT_ROLES, Role, TensorSpec, kv_tensor_index
from staticlm.runtime.family.quant_params import FamilyQuant, Quant, TensorQuant

Q_OPS, DQ_OPS = {"QuantizeLinear"}, {"DequantizeLinear"}


def _qtype(dtype: str):
    from onnxruntime.quantization import QuantType

    return {"uint16": QuantType.QUInt16, "uint8": QuantType.QUInt8, "int4": QuantType.QInt4}[dtype]


def _pinned(t: TensorQuant) -> list[dict]:
    return [{"quant_type": _qtype(t.dtype), "scale": np.array(t.scale, np.float32),
             "zero_point": np.array(t.zero_point, np.dtype(t.dtype))}]


def boundary_params(specs: tuple[TensorSpec, ...], fq: FamilyQuant, *, num_kv_heads: int) -> dict[str, TensorQuant]:
    """Graph I/O name -> the family parameters it must carry."""
    out = {}
    for s in specs:
        if s.role in (*KV_INPUT_ROLES, *KV_OUTPUT_ROLES, Role.PROMPT_KEY, Role.PROMPT_VALUE):  # prompt: segments
            is_value = s.role in (Role.PAST_VALUE, Role.NEW_VALUE, Role.PROMPT_VALUE)
            out[s.name] = fq.kv[kv_tensor_index(layer=s.layer, kv_head=s.kv_head, is_value=is_value,
                                                num_kv_heads=num_kv_heads)]
        elif s.role in (Role.ROPE_COS, Role.ROPE_SIN, Role.ROPE_COS_LOCAL, Role.ROPE_SIN_LOCAL) and fq.rope is not None:
            out[s.name] = fq.rope
        elif s.role in (Role.ATTENTION_BIAS, Role.ATTENTION_BIAS_LOCAL) and fq.mask is not None:
            out[s.name] = fq.mask
        elif s.role is Role.LOGITS and fq.logits is not None:
            out[s.name] = fq.logits
    return out


DATA_MOVEMENT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"}


def through_data_movement(float_path: Path, pinned: dict[str, TensorQuant]) -> dict[str, TensorQuant]:
    """Pin also the tensor a data-movement op copies into a pinned output (logits = Reshape(Gemm)):
    the quantizer gives such an op's output its input's parameters, ignoring an override on the output."""
    g = onnx.load(str(float_path), load_external_data=False).graph
    producer = {o: n for n in g.node for o in n.output}
    out = dict(pinned)
    for name, t in pinned.items():
        node = producer.get(name)
        while node is not None and node.op_type in DATA_MOVEMENT:
            out[node.input[0]] = t
            node = producer.get(node.input[0])
    return out


# ONNX Runtime's MinMax calibration takes the exact extremes of the calibration steps. Text outside them
# clips, and a clipped value is wrong by the whole overshoot. Widening every activation range costs
# log2(1.25) = 0.3 of 16 bits.
ACTIVATION_HEADROOM = 1.25
MINIMUM_REAL_RANGE = 0.0001  # get_qnn_qdq_config's extra option MinimumRealRange (checked in quantize_graph)


def tensors_to_calibrate(model: onnx.ModelProto, op_types: list[str] | None) -> list[str]:
    """The float activations ORT's calibrator would pick: inputs/outputs of the ops to quantize (model: its weights
    need not be loaded; its shapes are inferred here)."""
    g = onnx.shape_inference.infer_shapes(model).graph
    infos = {vi.name: vi for vi in (*g.value_info, *g.output, *g.input)}
    weights = {i.name for i in g.initializer}
    wanted = set(op_types or ())
    names = set()
    for node in g.node:
        if wanted and node.op_type not in wanted:
            continue
        for name in (*node.input, *node.output):
            vi = infos.get(name)
            if vi is not None and name not in weights and vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
                names.add(name)
    return sorted(names)


Ranges = dict[str, tuple[np.ndarray, np.ndarray]]  # activation -> (lowest, highest), widened


class RangeMinMax:
    """MinMax over steps as ORT's MinMaxCalibrater computes it (min and max over every step), widened."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.lo = {n: np.inf for n in names}
        self.hi = {n: -np.inf for n in names}

    def add(self, values: list[np.ndarray]) -> None:
        for n, value in zip(self.names, values):
            self.lo[n], self.hi[n] = min(self.lo[n], float(value.min())), max(self.hi[n], float(value.max()))

    def ranges(self) -> Ranges:
        lo, hi = self.lo, self.hi
        if not all(np.isfinite(lo[n]) for n in self.names):
            raise ValueError("calibration read no steps")
        return {n: (np.array(min(lo[n], 0.0) * ACTIVATION_HEADROOM + max(lo[n], 0.0), np.float32),
                    np.array(max(hi[n], 0.0) * ACTIVATION_HEADROOM + min(hi[n], 0.0), np.float32))
                for n in self.names}


def calibrated_ranges(float_path: Path, reader, names: list[str]) -> Ranges:
    """MinMax calibration of the named tensors (RangeMinMax), every range widened. The calibrator's own graph
    augmentation inserts two nodes per tensor with a linear search each (quadratic in the graph's size); listing
    the tensors as graph outputs and reducing them in numpy gives the same ranges."""
    minmax = RangeMinMax(names)
    for values in tensor_values(float_path, names, iter(reader.get_next, None)):
        minmax.add(values)
    return minmax.ranges()


def qdq_config(float_path: Path, *, quant: Quant, pinned: dict[str, TensorQuant],
               weight_overrides: dict[str, list[dict]]):
    """ONNX Runtime's QNN quantization config for float_path: pinned tensors (and what data movement copies into
    them) at their parameters, weight_overrides as given."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    overrides = {name: _pinned(t) for name, t in through_data_movement(float_path, pinned).items()}
    overrides.update(weight_overrides)
    config = get_qnn_qdq_config(
        str(float_path), None, activation_type=QuantType.QUInt16,
        weight_type=QuantType.QUInt8 if quant is Quant.W8A16 else QuantType.QInt4,
        per_channel=False, init_overrides=overrides, calibration_providers=["CPUExecutionProvider"])
    if config.extra_options.get("MinimumRealRange") != MINIMUM_REAL_RANGE:  # recalibrated() repeats the formula
        raise ValueError(f"onnxruntime's QNN config changed MinimumRealRange: {config.extra_options}")
    return config


def quantize_with_ranges(float_path: Path, out_path: Path, config, ranges: Ranges) -> None:
    """quantize() with config, reading ranges instead of calibrating. Weights go to one side file
    (use_external_data_format), moved into the family's file later."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData, save_tensors_data

    cache = out_path.with_suffix(".calibration.json")
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), cache)
    with _quantizer_notes_off():
        _quantize_static(float_path, out_path, config, cache)


def quantize_graph(float_path: Path, out_path: Path, *, reader, quant: Quant, pinned: dict[str, TensorQuant],
                   weight_overrides: dict[str, list[dict]]) -> Ranges:
    """QDQ model of the whole float_path (calibrated on reader) at out_path, its weights in out_path's .data file;
    returns the activation ranges it was calibrated with. One pass over the whole graph: its peak memory holds the
    float model (groups.py quantizes one layer group at a time)."""
    config = qdq_config(float_path, quant=quant, pinned=pinned, weight_overrides=weight_overrides)
    names = tensors_to_calibrate(onnx.load(str(float_path), load_external_data=False), config.op_types_to_quantize)
    ranges = calibrated_ranges(float_path, reader, names)
    quantize_with_ranges(float_path, out_path, config, ranges)
    return ranges


@contextlib.contextmanager
def _quantizer_notes_off():
    """ONNX Runtime's quantizer logs "Please consider pre-processing before quantization" on the root logger at each
    call (the graphs are built for it, shapes declared); an export's stderr keeps the progress and its own lines."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _quantize_static(float_path: Path, out_path: Path, config, cache: Path) -> None:
    from .ort_quantizer import quantize_with_index

    quantize_with_index(float_path, out_path, config, cache)


def recalibrated(model: onnx.ModelProto, *, calibrated: Ranges, ranges: Ranges,
                 pinned: frozenset[str]) -> onnx.ModelProto:
    """A copy of model (quantize_graph's output, calibrated on `calibrated`) with the activation parameters the
    quantizer computes from `ranges` instead: same nodes, same weights, same pinned and fixed parameters.

    A second quantizer pass over other calibration steps differs from the first in exactly these numbers
    (tests/test_htp.py::test_sink_recalibration_equals_a_second_quantizer_pass compares the two) but repeats
    the whole quantization, where this only recomputes parameters. A
    parameter is taken as calibrated only when it is not pinned (quantize_graph's pinned tensors, with
    through_data_movement) and the quantizer's formula on its `calibrated` range gives the value in the
    model; fixed-range outputs (Sigmoid, Softmax) and tensors sharing another tensor's parameters (Reshape)
    fail that check and stay as they are.
    """
    from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {i.name: i for i in out.graph.initializer}

    def params(lo_hi, zp_type: int):
        qmin, qmax = get_qmin_qmax_for_qType(zp_type, reduce_range=False, symmetric=False)
        zero, scale = compute_scale_zp(lo_hi[0], lo_hi[1], qmin, qmax, False, MINIMUM_REAL_RANGE)
        return np.float32(scale.squeeze()), zero.squeeze()

    # "_convert": the parameters of a tensor's second type where consumers want another one (uint16 -> uint8 KV)
    for (name, new_range), suffix in itertools.product(ranges.items(), ("", "_convert")):
        scale_init, zp_init = inits.get(f"{name}_scale{suffix}"), inits.get(f"{name}_zero_point{suffix}")
        if scale_init is None or zp_init is None or name not in calibrated or name in pinned:
            continue
        scale, zero = numpy_helper.to_array(scale_init), numpy_helper.to_array(zp_init)
        old_scale, old_zero = params(calibrated[name], zp_init.data_type)
        if scale.shape or scale != old_scale or zero != old_zero:
            continue  # not from this tensor's calibrated range
        new_scale, new_zero = params(new_range, zp_init.data_type)
        scale_init.CopyFrom(numpy_helper.from_array(np.array(new_scale, np.float32), scale_init.name))
        zp_init.CopyFrom(numpy_helper.from_array(np.array(new_zero, zero.dtype), zp_init.name))
    return out


# QNN HTP computes a MatMul of two uint16 activations (scores = K x Q^T, attention = P x V) with its second input
# converted to 8 bits (seen on the x86_64 emulator, onnxruntime-qnn 2.7.0): the products land on that input's
# 256-level grid, where a symmetric int16 second input is computed at 16 bits. Every KV row a graph writes drifted
# from the CPU EP's that way, most in a prompt chunk, whose many rows feed each other
# (tests/test_htp.py::test_htp_prompt_chunk_after_the_sink_matches_cpu_ep). So that input goes through a symmetric
# int16 copy over the same range (at most one bit coarser than uint16). The copy replaces the 8-bit one HTP made
# every step, but the MatMul then runs at 16 x 16 bits, which costs time per step (slower on the x86_64 emulator;
# not yet measured on a device). A uint8 input (an 8-bit KV family's V) is left as it is: QNN takes
# those MatMuls as they are and refuses them with an int16 copy.
SIGNED_OPERAND = "_int16"


def _uint16_activation(dq: onnx.NodeProto | None, inits: dict) -> bool:
    if dq is None or dq.op_type not in DQ_OPS or dq.input[0] in inits or len(dq.input) < 3:
        return False
    zp = inits.get(dq.input[2])
    return zp is not None and zp.data_type == onnx.TensorProto.UINT16


def _symmetric_int16(scale: float, zero_point: int) -> np.float32:
    """The int16 scale with zero point 0 whose range holds everything the uint16 tensor represents."""
    return np.float32(max(zero_point, np.iinfo(np.uint16).max - zero_point) * scale / np.iinfo(np.int16).max)


def signed_matmul_operands(model: onnx.ModelProto) -> onnx.ModelProto:
    """In place: the second input of each MatMul of two uint16 activations goes through a symmetric int16 copy
    (DQ -> Q int16 -> DQ -> MatMul; HTP runs the Q as one conversion). Run again after the uint16 tensors'
    parameters changed (recalibrated): the int16 scales follow them."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    nodes: list[onnx.NodeProto] = []
    made: dict[str, str] = {}  # operand -> its int16 dequantized copy
    for node in g.node:
        if node.op_type == "MatMul" and len(node.input) == 2:
            operand = node.input[1]
            dq = producer.get(operand)
            if operand.endswith(f"{SIGNED_OPERAND}_dequantized"):  # done before: the scale follows the source
                q = producer[dq.input[0]]
                source = producer[q.input[0]]
                scale, zp = (numpy_helper.to_array(inits[n]) for n in source.input[1:3])
                inits[q.input[1]].CopyFrom(numpy_helper.from_array(
                    np.array(_symmetric_int16(float(scale), int(zp))), q.input[1]))
            elif _uint16_activation(dq, inits) and _uint16_activation(producer.get(node.input[0]), inits):
                if operand not in made:
                    scale, zp = (numpy_helper.to_array(inits[n]) for n in dq.input[1:3])
                    if scale.size != 1:
                        raise ValueError(f"{operand}: per-tensor parameters expected")
                    s, z = f"{operand}{SIGNED_OPERAND}_scale", f"{operand}{SIGNED_OPERAND}_zero_point"
                    g.initializer.extend([
                        numpy_helper.from_array(np.array(_symmetric_int16(float(scale), int(zp))), s),
                        numpy_helper.from_array(np.array(0, np.int16), z)])
                    inits = {i.name: i for i in g.initializer}
                    quantized, made[operand] = f"{operand}{SIGNED_OPERAND}", f"{operand}{SIGNED_OPERAND}_dequantized"
                    nodes += [helper.make_node("QuantizeLinear", [operand, s, z], [quantized],
                                               name=f"{quantized}_QuantizeLinear"),
                              helper.make_node("DequantizeLinear", [quantized, s, z], [made[operand]],
                                               name=f"{quantized}_DequantizeLinear")]
                node.input[1] = made[operand]
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return model


def strip_boundary(model: onnx.ModelProto, pinned: dict[str, TensorQuant]) -> onnx.ModelProto:
    """Make each pinned graph input/output its integer form, removing the boundary Q (inputs) / DQ (outputs).

    Input x: x -> Q -> q -> DQ -> ... becomes x(int) -> DQ -> ...
    Output y: ... -> Q -> q -> DQ -> y becomes ... -> Q -> y(int); consumers inside the graph that read
    the DQ output keep reading a DQ (of the integer output), so the step's own attention sees exactly
    the integers the next step will read back.
    """
    g = model.graph
    nodes = list(g.node)  # these objects are the ones edited and written back
    wiring = _Wiring(nodes)
    removed = [_strip_input(wiring, vi, pinned[vi.name]) for vi in g.input if vi.name in pinned]
    for vo in g.output:
        if vo.name in pinned:
            removed += _strip_output(wiring, vo, pinned[vo.name])
    if removed:
        gone = {id(n) for n in removed}  # nodes holds every node, so no id is reused meanwhile
        kept = [n for n in nodes if id(n) not in gone]
        del g.node[:]
        g.node.extend(kept)
    return model


class _Wiring:
    """One index of a graph's producers and readers, kept up to date by every rename: a search of the whole graph
    per boundary tensor made strip_boundary quadratic (hundreds of KV tensors x thousands of nodes in a 30-layer
    model)."""

    def __init__(self, nodes: list[onnx.NodeProto]) -> None:
        self.producer = {o: n for n in nodes for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in nodes:
            for i in dict.fromkeys(n.input):
                self.readers[i].append(n)

    def rename(self, node: onnx.NodeProto, old: str, new: str) -> None:
        node.input[:] = [new if i == old else i for i in node.input]
        self.readers[old] = [n for n in self.readers[old] if n is not node]
        if not any(n is node for n in self.readers[new]):
            self.readers[new].append(node)

    def move_readers(self, old: str, new: str, *, only: list[onnx.NodeProto] | None = None) -> None:
        """Every reader of old (or those of only) reads new instead."""
        for n in list(self.readers[old]) if only is None else only:
            self.rename(n, old, new)


def _strip_input(wiring: _Wiring, vi: onnx.ValueInfoProto, tq: TensorQuant) -> onnx.NodeProto:
    """x -> Q -> q -> DQ becomes x(int) -> DQ; returns the Q, to be removed."""
    (q,) = [n for n in wiring.readers[vi.name] if n.op_type in Q_OPS] or [None]
    if q is None or len(wiring.readers[vi.name]) != 1:
        raise ValueError(f"input {vi.name}: expected exactly one QuantizeLinear consumer")
    wiring.readers[vi.name] = []
    wiring.move_readers(q.output[0], vi.name)
    vi.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(tq.dtype))
    return q


def _strip_output(wiring: _Wiring, vo: onnx.ValueInfoProto, tq: TensorQuant) -> list[onnx.NodeProto]:
    """Q -> q -> DQ -> y becomes Q -> y(int), the DQ kept (renamed) for readers inside the graph; returns the DQ
    when none reads it, to be removed."""
    dq = wiring.producer.get(vo.name)
    if dq is None or dq.op_type not in DQ_OPS:
        raise ValueError(f"output {vo.name}: not produced by a DequantizeLinear")
    q_out = dq.input[0]
    q = wiring.producer[q_out]
    if q.op_type not in Q_OPS:
        raise ValueError(f"output {vo.name}: its DequantizeLinear does not read a QuantizeLinear")
    wiring.move_readers(q_out, vo.name)  # the integer tensor takes the output's name
    q.output[0] = vo.name
    del wiring.producer[q_out]
    wiring.producer[vo.name] = q
    vo.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(tq.dtype))
    inner = [n for n in wiring.readers[vo.name] if n is not dq]
    if not inner:
        wiring.readers[vo.name] = []
        return [dq]
    deq = f"{vo.name}_dequantized"  # keep the DQ for in-graph readers, under a new name
    dq.output[0] = deq
    wiring.producer[deq] = dq
    wiring.move_readers(vo.name, deq, only=inner)
    return []
