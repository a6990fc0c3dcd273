"""One segmented graph (GraphKind.SEGMENT) bound to a request's SegmentKV (kv_manager/segments.py).

The prompt segment's inputs are bound once per request (when the SegmentKV changes): [N_prompt, D] (symbolic
length, the cpu layout) or the [1, 1, P_prompt, D] window ending at the prompt's end (static, the HTP layout). The
response buffers ([B, Hkv, P, D] per (layer, K|V), or [B, 1, P, D] per tensor) are bound once per buffer
allocation; each step moves only the new rows' slot addresses, like WindowRunner, and writes rope rows at the
positions after the prompt and the bias. A quantized family's rope, bias and logits are converted at the boundary
as WindowRunner does; its KV never is.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from staticlm.kv_manager.segments import SegmentKV, segment_bias
from staticlm.runtime.engine.runner import FamilyContext
from staticlm.runtime.engine.window_runner import _graph_array, run_converted
from staticlm.runtime.family.contract import KV_INPUT_ROLES, KV_OUTPUT_ROLES, Role, TensorSpec
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.segments import PROMPT_ROLES, static_prompt_len
from staticlm.runtime.session.ort_binding import BindingTable, IOBinding


def _kv_table(specs: tuple[TensorSpec, ...], roles: tuple[Role, Role], *, num_kv_heads: int) -> BindingTable:
    """KV specs in the kv_manager's [T, B] address order: kv_tensor_index (layer, head, K then V), then sequence."""
    kv = sorted((s for s in specs if s.role in roles),
                key=lambda s: ((s.layer * num_kv_heads + s.kv_head) * 2 + (s.role == roles[1]), s.seq or 0))
    return [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv]


class SegmentRunner:
    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, family: FamilyContext) -> None:
        self.entry, self.shape = entry, entry.shape
        self._rope = family.rope
        self._binding = IOBinding(session)
        by_role = {s.role: s for s in entry.inputs}
        self.input_ids = np.zeros(by_role[Role.INPUT_IDS].shape, np.int64)  # [B, AR]
        self._row_offsets = np.arange(self.shape.ar)  # [AR]
        self._positions = np.zeros(self.input_ids.shape, np.int64)  # [B, AR] absolute positions of the new rows
        self.rope_cos = np.zeros(by_role[Role.ROPE_COS].shape, np.float32)  # [B, 1, AR, D]
        self.rope_sin = np.zeros(by_role[Role.ROPE_SIN].shape, np.float32)  # [B, 1, AR, D]
        self.prompt_len = static_prompt_len(entry)  # None: bound at the prompt's own rows
        # [B, 1, AR, P + AR], or [B, 1, AR, P_prompt + P + AR] with a static prompt window
        self.attention_bias = np.zeros(by_role[Role.ATTENTION_BIAS].shape, np.float32)
        logits = next(s for s in entry.outputs if s.role == Role.LOGITS)
        self.logits = np.zeros(logits.shape, np.float32)  # [B, AR, V]
        self._to_graph, self._from_graph = [], []  # (float host array, its TensorQuant, the graph's integer twin)
        for role, array in ((Role.INPUT_IDS, self.input_ids), (Role.ROPE_COS, self.rope_cos),
                            (Role.ROPE_SIN, self.rope_sin), (Role.ATTENTION_BIAS, self.attention_bias)):
            self._binding.bind_input(by_role[role].name, _graph_array(by_role[role], array, quant=family.quant,
                                                                      conversions=self._to_graph))
        self._binding.bind_output(logits.name, _graph_array(logits, self.logits, quant=family.quant,
                                                            conversions=self._from_graph))
        num_kv_heads = family.config.num_kv_heads
        self._prompt = _kv_table(entry.inputs, PROMPT_ROLES, num_kv_heads=num_kv_heads)  # [T], resized per request
        # in the ResponseCache's buffer order: (layer, K|V), or (layer, head, K|V) with one head per buffer
        buffers = sorted((s for s in entry.inputs if s.role in KV_INPUT_ROLES),
                         key=lambda s: (s.layer, s.kv_head or 0, s.role == Role.PAST_VALUE))
        self._buffer_names = [s.name for s in buffers]
        self._kv_outputs = _kv_table(entry.outputs, KV_OUTPUT_ROLES, num_kv_heads=num_kv_heads)  # [T x B]
        self._bound_prompt: tuple[int, ...] | None = None  # the SegmentKV's prompt_version it was bound at
        self._bound_buffers: tuple[int, int] | None = None  # (the SegmentKV's serial, its response buffer generation)

    def run(self, segments: SegmentKV) -> np.ndarray:
        past_len, ar = self.shape.past_len, self.shape.ar
        responses = segments.responses
        if responses.capacity != past_len:
            raise ValueError(f"graph {self.entry.name} reads {past_len} response rows, the buffer has "
                             f"{responses.capacity}")
        np.add((segments.num_prompt_rows + responses.lengths)[:, None], self._row_offsets, out=self._positions)
        self._rope.fill(self._positions, cos_out=self.rope_cos, sin_out=self.rope_sin)
        segment_bias(num_prompt=segments.num_prompt_rows, prompt_len=self.prompt_len or 0, lengths=responses.lengths,
                     past_len=past_len, ar=ar, out=self.attention_bias)
        self._bind_prompt(segments)
        self._bind_buffers(segments)
        self._binding.bind_outputs_at(self._kv_outputs, responses.slot_addresses(ar).ravel().tolist())
        run_converted(self._binding, to_graph=self._to_graph, from_graph=self._from_graph)
        return self.logits

    def _bind_prompt(self, segments: SegmentKV) -> None:
        """The prompt segment's windows, once per request (and again only if its buffer was reallocated)."""
        key = segments.prompt_version
        if key == self._bound_prompt:
            return
        if self.prompt_len is None:
            rows = segments.num_prompt_rows
            table = [(name, dtype, [rows, shape[-1]]) for name, dtype, shape in self._prompt]  # [N_prompt, D]
        else:
            rows, table = self.prompt_len, self._prompt  # [1, 1, P_prompt, D], left padding masked by the bias
        self._binding.bind_inputs_at(table, segments.prompt_addresses(rows).tolist())
        self._bound_prompt = key

    def _bind_buffers(self, segments: SegmentKV) -> None:
        """Each response buffer [B, Hkv, P, D] as one input, again only after a reallocation."""
        key = (segments.serial, segments.responses.buffer_generation)
        if key == self._bound_buffers:
            return
        for name, buf in zip(self._buffer_names, segments.responses.buffers(), strict=True):
            self._binding.bind_input(name, buf)
        self._bound_buffers = key
