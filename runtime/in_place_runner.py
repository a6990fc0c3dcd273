"""One in-place graph (KVLayout.IN_PLACE, ORT's GroupQueryAttention), bound to the kv_manager's buffers.

Each (layer, K|V) buffer [B, Hkv, C, D] is bound as both the past input and the present output, once per
buffer allocation (the in-place cache allocates once). A step writes only a few integers into host arrays
that are bound once: the token ids, their positions and the row counts.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from staticlm.runtime.family.contract import BUFFER_OUTPUT_ROLES, KV_INPUT_ROLES, Role
from staticlm.runtime.family.manifest import GraphEntry


class InPlaceRunner:
    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, max_positions: int) -> None:
        self.session, self.entry, self.shape = session, entry, entry.shape
        self._binding = C.SessionIOBinding(session._sess)
        self._cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        b, ar = self.shape.batch, self.shape.ar
        self.max_positions = max_positions
        self.input_ids = np.zeros((b, ar), np.int64)  # [B, AR]
        self.position_ids = np.zeros((b, ar), np.int64)  # [B, AR] absolute positions (they survive a slide)
        self.seqlens_k = np.zeros(b, np.int32)  # [B] rows cached after the step, minus one
        self.total_length = np.zeros((), np.int32)  # [] an upper bound of those rows, at least AR
        self.query_lengths = np.zeros(b, np.int32)  # [B] real rows of the step
        self.row_offsets = np.arange(ar)  # [AR]
        names = {s.role: s.name for s in entry.inputs if s.role not in KV_INPUT_ROLES}
        for role, array in ((Role.INPUT_IDS, self.input_ids), (Role.POSITION_IDS, self.position_ids),
                            (Role.SEQLENS_K, self.seqlens_k), (Role.TOTAL_LENGTH, self.total_length),
                            (Role.QUERY_LENGTHS, self.query_lengths)):
            self._binding.bind_input(names[role], self._cpu, array.dtype, list(array.shape), array.ctypes.data)
        logits = next(s for s in entry.outputs if s.role == Role.LOGITS)
        self.logits = np.zeros(logits.shape, np.float32)  # [B, AR, V]
        self._binding.bind_output(logits.name, self._cpu, self.logits.dtype, list(self.logits.shape),
                                  self.logits.ctypes.data)
        by_layer = lambda specs, roles: sorted((s for s in specs if s.role in roles),  # noqa: E731
                                               key=lambda s: (s.layer, s.role == roles[1]))
        # buffer g = 2 layer + (V): the kv_manager's buffer order
        self._buffer_names = list(zip((s.name for s in by_layer(entry.inputs, KV_INPUT_ROLES)),
                                      (s.name for s in by_layer(entry.outputs, BUFFER_OUTPUT_ROLES))))
        self._bound: tuple[int, int] | None = None  # (id of the cache, its buffer generation)

    def set_rows(self, *, lengths: np.ndarray, positions: np.ndarray, num_real: int) -> None:
        """lengths [B] rows cached before the step, positions [B] the absolute position of the first new row."""
        np.minimum(positions[:, None] + self.row_offsets, self.max_positions - 1, out=self.position_ids)
        self.query_lengths[:] = num_real
        self.seqlens_k[:] = lengths + (num_real - 1)
        self.total_length[...] = max(int(lengths.max()) + num_real, self.shape.ar)

    def bind_buffers(self, kv) -> None:
        """Bind every buffer as past and present, unless this cache's current buffers already are."""
        key = (id(kv), kv.buffer_generation)
        if key == self._bound:
            return
        bind_in, bind_out, dev = self._binding.bind_input, self._binding.bind_output, self._cpu
        for (past, present), buf in zip(self._buffer_names, kv.buffers(), strict=True):
            bind_in(past, dev, buf.dtype, list(buf.shape), buf.ctypes.data)
            bind_out(present, dev, buf.dtype, list(buf.shape), buf.ctypes.data)
        self._bound = key

    def run(self) -> None:
        self.session._sess.run_with_iobinding(self._binding, None)
