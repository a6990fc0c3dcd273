"""One graph of the family, bound straight into the kv_manager's buffers.

The binding table (names, shapes, element types, device) is built once per graph;
each step only moves the KV addresses. Host inputs and logits live in arrays
allocated here once and bound once.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from staticlm.export.contract import KV_INPUT_ROLES, KV_OUTPUT_ROLES, Role
from staticlm.export.manifest import GraphEntry


def _kv_order(specs, roles, num_kv_heads: int):
    """KV specs in the kv_manager's [T, B] address order: kv_tensor_index (layer, head, K then V), then sequence."""
    kv = [s for s in specs if s.role in roles]
    return sorted(kv, key=lambda s: ((s.layer * num_kv_heads + s.kv_head) * 2 + (s.role == roles[1]), s.seq or 0))


class GraphRunner:
    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, num_kv_heads: int) -> None:
        self.session, self.entry, self.shape = session, entry, entry.shape
        self._binding = C.SessionIOBinding(session._sess)
        # Building an OrtDevice per call costs more than the binding itself (field notes): cache it.
        self._cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        by_role = {s.role: s for s in entry.inputs if s.role not in KV_INPUT_ROLES}
        self.input_ids = np.zeros(by_role[Role.INPUT_IDS].shape, np.int64)  # [B, AR]
        self.row_offsets = np.arange(self.shape.ar)  # [AR] position of each new row after the cached ones
        self.rope_cos = np.zeros(by_role[Role.ROPE_COS].shape, by_role[Role.ROPE_COS].dtype)  # [B, 1, AR, D]
        self.rope_sin = np.zeros(by_role[Role.ROPE_SIN].shape, by_role[Role.ROPE_SIN].dtype)  # [B, 1, AR, D]
        bias = by_role[Role.ATTENTION_BIAS]
        self.attention_bias = np.zeros(bias.shape, bias.dtype)  # [B, 1, AR, P + AR]
        logits = next(s for s in entry.outputs if s.role == Role.LOGITS)
        self.logits = np.zeros(logits.shape, logits.dtype)  # [B, AR, V]
        for spec, array in ((by_role[Role.INPUT_IDS], self.input_ids), (by_role[Role.ROPE_COS], self.rope_cos),
                            (by_role[Role.ROPE_SIN], self.rope_sin), (bias, self.attention_bias)):
            self._bind_input(spec.name, array)
        self._binding.bind_output(logits.name, self._cpu, self.logits.dtype, list(self.logits.shape),
                                  self.logits.ctypes.data)
        kv_in = _kv_order(entry.inputs, KV_INPUT_ROLES, num_kv_heads)
        kv_out = _kv_order(entry.outputs, KV_OUTPUT_ROLES, num_kv_heads)
        self._kv_inputs = [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv_in]
        self._kv_outputs = [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv_out]
        self.bound_kv_inputs: np.ndarray | None = None  # [num_tensors, B] addresses of the last bind
        self.bound_kv_outputs: np.ndarray | None = None

    @property
    def num_kv_tensors(self) -> int:
        return len(self._kv_inputs)

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
        self.session._sess.run_with_iobinding(self._binding, None)
