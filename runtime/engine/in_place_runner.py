"""One in-place graph (KVLayout.IN_PLACE, ORT's GroupQueryAttention), bound to the kv_manager's buffers.

Each (layer, K|V) buffer [B, Hkv, C, D] is bound as both the past input and the present output, once per
buffer allocation (the in-place cache allocates once). A step writes only a few integers into host arrays
that are bound once: the token ids, their positions and the row counts.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from staticlm.kv_manager import KVCache
from staticlm.runtime.engine.runner import FamilyContext, bind_hidden
from staticlm.runtime.family.contract import BUFFER_OUTPUT_ROLES, KV_INPUT_ROLES, Role, TensorSpec
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.session.ort_binding import IOBinding


def _by_buffer(specs: tuple[TensorSpec, ...], roles: tuple[Role, Role]) -> list[tuple[str, int]]:
    """(name, buffer) in the kv_manager's buffer order: buffer g = 2 layer + (V) (a part binds its layers' only)."""
    return [(s.name, 2 * s.layer + (s.role == roles[1]))
            for s in sorted((s for s in specs if s.role in roles), key=lambda s: (s.layer, s.role == roles[1]))]


class InPlaceRunner:
    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, family: FamilyContext) -> None:
        self.entry, self.shape = entry, entry.shape
        self._binding = IOBinding(session)
        b, ar = self.shape.batch, self.shape.ar
        self._max_position = family.config.max_positions - 1
        self.input_ids = np.zeros((b, ar), np.int64)  # [B, AR]
        self.position_ids = np.zeros((b, ar), np.int64)  # [B, AR] absolute positions (they survive a slide)
        self.seqlens_k = np.zeros(b, np.int32)  # [B] rows cached after the step, minus one
        self.total_length = np.zeros((), np.int32)  # [] an upper bound of those rows, at least AR
        self.query_lengths = np.zeros(b, np.int32)  # [B] real rows of the step
        self._row_offsets = np.arange(ar)  # [AR]
        names = {s.role: s.name for s in entry.inputs if s.role not in KV_INPUT_ROLES}
        for role, array in ((Role.INPUT_IDS, self.input_ids), (Role.POSITION_IDS, self.position_ids),
                            (Role.SEQLENS_K, self.seqlens_k), (Role.TOTAL_LENGTH, self.total_length),
                            (Role.QUERY_LENGTHS, self.query_lengths)):
            if role in names:  # a layer-group part (export/parts.py) takes only what its layers read
                self._binding.bind_input(names[role], array)
        logits = next((s for s in entry.outputs if s.role == Role.LOGITS), None)
        # [B, AR, V], or [B, 1, V]: the last real row only; None for a part before the last
        self.logits = None if logits is None else np.zeros(logits.shape, np.float32)
        if logits is not None:
            self._binding.bind_output(logits.name, self.logits)
        # The rows the head scores, when the graph takes them as an input (one graph file for every shape):
        # every row of each sequence, or its last real row (set per step in _set_rows)
        self._last_row_only = logits is not None and logits.shape[1] == 1 and ar > 1
        self.logits_index = None
        if Role.LOGITS_INDEX in names:
            rows = logits.shape[1] if logits is not None else ar
            self.logits_index = (np.arange(b, dtype=np.int64) * ar if self._last_row_only
                                 else np.arange(b * rows, dtype=np.int64))  # [B R] flat rows of [B AR]
            self._first_rows = self.logits_index.copy()
            self._binding.bind_input(names[Role.LOGITS_INDEX], self.logits_index)
        # (past name, present name, buffer index)
        self._buffer_names = [(past, present, g) for (past, g), (present, _g) in zip(
            _by_buffer(entry.inputs, KV_INPUT_ROLES), _by_buffer(entry.outputs, BUFFER_OUTPUT_ROLES), strict=True)]
        self._bound: tuple[int, int] | None = None  # (id of the cache, its buffer generation)
        # local layers (a LayeredKVCache): the row counts of their own buffers
        self._local = Role.SEQLENS_K_LOCAL in names
        if self._local:
            self.seqlens_k_local = np.zeros(b, np.int32)  # [B]
            self.total_length_local = np.zeros((), np.int32)  # []
            self._binding.bind_input(names[Role.SEQLENS_K_LOCAL], self.seqlens_k_local)
            self._binding.bind_input(names[Role.TOTAL_LENGTH_LOCAL], self.total_length_local)

    def bind_hidden(self, arrays: Mapping[str, np.ndarray]) -> None:
        """A layer-group part's residual stream at its cuts (runner.PartRunner)."""
        bind_hidden(self._binding, self.entry, arrays)

    def run(self, kv: KVCache, *, num_real: int, active: np.ndarray | None = None) -> np.ndarray:
        """active [B]: only these rows attend (a graph of staticlm's CachedAttention, whose rows of 0 query
        length neither write nor read a row); None: every row."""
        self._set_rows(lengths=kv.lengths, positions=kv.positions, num_real=num_real, active=active)
        if self._local:
            np.add(kv.local_lengths, self.query_lengths, out=self.seqlens_k_local)
            self.seqlens_k_local -= 1
            self.total_length_local[...] = max(int(kv.local_lengths.max()) + num_real, self.shape.ar)
        return self._run_bound(kv)

    def run_rows(self, kv: KVCache, *, lengths: np.ndarray, positions: np.ndarray, num_real: int) -> np.ndarray:
        """Run with the new rows at row lengths[b] (position positions[b]) of kv's buffers, whatever kv's own
        lengths: a KV-Runahead worker writes its chunk's rows there (runtime/engine/runahead.py)."""
        self._set_rows(lengths=lengths, positions=positions, num_real=num_real)
        return self._run_bound(kv)

    def _run_bound(self, kv: KVCache) -> np.ndarray:
        self._bind_buffers(kv)
        self._binding.run()
        return self.logits

    def _set_rows(self, *, lengths: np.ndarray, positions: np.ndarray, num_real: int,
                  active: np.ndarray | None = None) -> None:
        """lengths [B] rows cached before the step, positions [B] the absolute position of the first new row,
        active [B] the rows that run (None: all)."""
        np.add(positions[:, None], self._row_offsets, out=self.position_ids)
        np.minimum(self.position_ids, self._max_position, out=self.position_ids)
        if active is None:
            self.query_lengths[:] = num_real
        else:  # an idle row (a free one holding a cached prefix) attends to nothing: its rows are not read
            np.multiply(active, num_real, out=self.query_lengths, casting="unsafe")
        if self._last_row_only and self.logits_index is not None:
            np.add(self._first_rows, num_real - 1, out=self.logits_index)
        np.add(lengths, self.query_lengths, out=self.seqlens_k)
        self.seqlens_k -= 1
        self.total_length[...] = max(int(lengths.max()) + num_real, self.shape.ar)

    def _bind_buffers(self, kv: KVCache) -> None:
        """Bind every buffer as past and present, unless this cache's current buffers already are."""
        key = (id(kv), kv.buffer_generation)
        if key == self._bound:
            return
        buffers = kv.buffers()
        for past, present, g in self._buffer_names:
            self._binding.bind_input(past, buffers[g])
            self._binding.bind_output(present, buffers[g])
        self._bound = key
