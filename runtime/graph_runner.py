"""One graph of the family, bound straight into the kv_manager's buffers.

The binding table (names, shapes, element types, device) is built once per graph;
each step only moves the KV addresses. Host inputs and logits live in arrays
allocated here once and bound once.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from staticlm.runtime.family.contract import KV_INPUT_ROLES, KV_OUTPUT_ROLES, Role
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.quant_params import FamilyQuant


def _kv_order(specs, roles, num_kv_heads: int):
    """KV specs in the kv_manager's [T, B] address order: kv_tensor_index (layer, head, K then V), then sequence."""
    kv = [s for s in specs if s.role in roles]
    return sorted(kv, key=lambda s: ((s.layer * num_kv_heads + s.kv_head) * 2 + (s.role == roles[1]), s.seq or 0))


class GraphRunner:
    """quant (a quantized family's FamilyQuant): the engine still writes float rope/mask into rope_cos,
    rope_sin and attention_bias and reads float logits; the runner converts them at the boundary (a few
    thousand elements per step; KV is never converted)."""

    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, num_kv_heads: int,
                 quant: FamilyQuant | None = None) -> None:
        self.session, self.entry, self.shape = session, entry, entry.shape
        self._binding = C.SessionIOBinding(session._sess)
        # Building an OrtDevice per call costs more than the binding itself (field notes): cache it.
        self._cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        by_role = {s.role: s for s in entry.inputs if s.role not in KV_INPUT_ROLES}
        self.input_ids = np.zeros(by_role[Role.INPUT_IDS].shape, np.int64)  # [B, AR]
        self.row_offsets = np.arange(self.shape.ar)  # [AR] position of each new row after the cached ones
        self.rope_cos = np.zeros(by_role[Role.ROPE_COS].shape, np.float32)  # [B, 1, AR, D]
        self.rope_sin = np.zeros(by_role[Role.ROPE_SIN].shape, np.float32)  # [B, 1, AR, D]
        bias = by_role[Role.ATTENTION_BIAS]
        self.attention_bias = np.zeros(bias.shape, np.float32)  # [B, 1, AR, P + AR]
        logits = next(s for s in entry.outputs if s.role == Role.LOGITS)
        self.logits = np.zeros(logits.shape, np.float32)  # [B, AR, V]
        # (float array the engine uses, params or None, the array bound to the graph in its own dtype)
        self._to_graph, self._from_graph = [], []
        for spec, array in ((by_role[Role.INPUT_IDS], self.input_ids), (by_role[Role.ROPE_COS], self.rope_cos),
                            (by_role[Role.ROPE_SIN], self.rope_sin), (bias, self.attention_bias)):
            self._bind_input(spec.name, self._graph_array(spec, array, quant, self._to_graph))
        out = self._graph_array(logits, self.logits, quant, self._from_graph)
        self._binding.bind_output(logits.name, self._cpu, out.dtype, list(out.shape), out.ctypes.data)
        kv_in = _kv_order(entry.inputs, KV_INPUT_ROLES, num_kv_heads)
        kv_out = _kv_order(entry.outputs, KV_OUTPUT_ROLES, num_kv_heads)
        self._kv_inputs = [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv_in]
        self._kv_outputs = [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv_out]
        self.bound_kv_inputs: np.ndarray | None = None  # [num_tensors, B] addresses of the last bind
        self.bound_kv_outputs: np.ndarray | None = None

    @property
    def num_kv_tensors(self) -> int:
        return len(self._kv_inputs)

    @staticmethod
    def _graph_array(spec, host: np.ndarray, quant: FamilyQuant | None, conversions: list) -> np.ndarray:
        """The array to bind: host itself when the dtypes agree, else an integer twin converted each run."""
        if np.dtype(spec.dtype) == host.dtype:
            return host
        params = {Role.ROPE_COS: "rope", Role.ROPE_SIN: "rope", Role.ATTENTION_BIAS: "mask", Role.LOGITS: "logits"}
        tq = getattr(quant, params[spec.role], None) if quant is not None else None
        if tq is None or np.dtype(tq.dtype) != np.dtype(spec.dtype):
            raise ValueError(f"{spec.name} is {spec.dtype} but the manifest has no matching quantization parameters")
        twin = np.zeros(spec.shape, spec.dtype)
        conversions.append((host, tq, twin))
        return twin

    def _bind_input(self, name: str, array: np.ndarray) -> None:
        self._binding.bind_input(name, self._cpu, array.dtype, list(array.shape), array.ctypes.data)

    def bind_kv(self, window_addresses: np.ndarray, slot_addresses: np.ndarray) -> None:
        """Point every past input at its window and every new output at its slot; addresses are [T, B]."""
        bind_in, bind_out, dev = self._binding.bind_input, self._binding.bind_output, self._cpu
        for (name, dtype, shape), addr in zip(self._kv_inputs, window_addresses.ravel().tolist()):
            bind_in(name, dev, dtype, shape, addr)
        for (name, dtype, shape), addr in zip(self._kv_outputs, slot_addresses.ravel().tolist()):
            bind_out(name, dev, dtype, shape, addr)
        self.bound_kv_inputs, self.bound_kv_outputs = window_addresses, slot_addresses

    def run(self) -> None:
        for host, tq, twin in self._to_graph:
            tq.quantize(host, out=twin)
        self.session._sess.run_with_iobinding(self._binding, None)
        for host, tq, twin in self._from_graph:
            tq.dequantize(twin, out=host)
