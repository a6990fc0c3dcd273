"""One per-head window graph (KVLayout.PER_HEAD), bound straight into the kv_manager's buffers.

The KV binding tables (names, shapes, element types) are built once per graph; each step writes the host
inputs (rope cos/sin, attention bias) in place and moves only the KV addresses. Host inputs and logits live
in arrays allocated here once and bound once.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from staticlm.kv_manager import KVCache, attention_bias
from staticlm.runtime.engine.runner import FamilyContext, bind_hidden
from staticlm.runtime.family.contract import KV_INPUT_ROLES, KV_OUTPUT_ROLES, Role, TensorSpec, graph_io
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.family.quant_params import FamilyQuant
from staticlm.runtime.session.ort_binding import BindingTable, IOBinding

# which FamilyQuant parameters convert a host input or output the graph takes in an integer type
QUANT_PARAMS = {Role.ROPE_COS: "rope", Role.ROPE_SIN: "rope", Role.ATTENTION_BIAS: "mask", Role.LOGITS: "logits",
                Role.ROPE_COS_LOCAL: "rope", Role.ROPE_SIN_LOCAL: "rope", Role.ATTENTION_BIAS_LOCAL: "mask"}


def _kv_table(specs: tuple[TensorSpec, ...], roles: tuple[Role, Role], *, num_kv_heads: int
              ) -> tuple[BindingTable, np.ndarray]:
    """KV specs in the kv_manager's [T, B] address order: kv_tensor_index (layer, head, K then V), then sequence;
    and the tensor indices they cover (all T, or a layer-group part's layers: export/parts.py)."""
    def index(s: TensorSpec) -> int:
        return (s.layer * num_kv_heads + s.kv_head) * 2 + (s.role == roles[1])

    kv = sorted((s for s in specs if s.role in roles), key=lambda s: (index(s), s.seq or 0))
    return [(s.name, np.dtype(s.dtype), list(s.shape)) for s in kv], np.unique(np.array([index(s) for s in kv], int))


def _graph_array(spec: TensorSpec, host: np.ndarray, *, quant: FamilyQuant | None, conversions: list) -> np.ndarray:
    """The array to bind: host itself when the dtypes agree, else an integer twin converted each run."""
    if np.dtype(spec.dtype) == host.dtype:
        return host
    tq = getattr(quant, QUANT_PARAMS[spec.role], None) if quant is not None else None
    if tq is None or np.dtype(tq.dtype) != np.dtype(spec.dtype):
        raise ValueError(f"{spec.name} is {spec.dtype} but the manifest has no matching quantization parameters")
    twin = np.zeros(spec.shape, spec.dtype)
    conversions.append((host, tq, twin))
    return twin


def run_converted(binding: IOBinding, *, to_graph: list, from_graph: list) -> None:
    """One run: the float host inputs into their integer twins first (_graph_array), the outputs back after."""
    for host, tq, twin in to_graph:
        tq.quantize(host, out=twin)
    binding.run()
    for host, tq, twin in from_graph:
        tq.dequantize(twin, out=host)


class WindowRunner:
    """A quantized family's runner still writes float rope/mask and reads float logits; it converts them at
    the boundary (a few thousand elements per step; KV is never converted)."""

    def __init__(self, session: ort.InferenceSession, entry: GraphEntry, *, family: FamilyContext) -> None:
        self.entry, self.shape = entry, entry.shape
        self._rope = family.rope
        self._binding = IOBinding(session)
        # a part without attention (the embedding's, the head's) reads no RoPE rows or mask: the whole graph's shapes
        by_role = {s.role: s for s in graph_io(family.config, self.shape)[0] if s.role not in KV_INPUT_ROLES}
        by_role |= {s.role: s for s in entry.inputs if s.role not in KV_INPUT_ROLES}
        self.input_ids = np.zeros((self.shape.batch, self.shape.ar), np.int64)  # [B, AR]
        self._row_offsets = np.arange(self.shape.ar)  # [AR] position of each new row after the cached ones
        self._positions = np.zeros(self.input_ids.shape, np.int64)  # [B, AR] absolute position of each new row
        self.rope_cos = np.zeros(by_role[Role.ROPE_COS].shape, np.float32)  # [B, 1, AR, D]
        self.rope_sin = np.zeros(by_role[Role.ROPE_SIN].shape, np.float32)  # [B, 1, AR, D]
        self.attention_bias = np.zeros(by_role[Role.ATTENTION_BIAS].shape, np.float32)  # [B, 1, AR, P + AR]
        logits = next((s for s in entry.outputs if s.role == Role.LOGITS), None)  # None: a part before the last
        self.logits = None if logits is None else np.zeros(logits.shape, np.float32)  # [B, AR, V]
        # (float array written here, its TensorQuant, the array bound to the graph in its own dtype)
        self._to_graph, self._from_graph = [], []
        for role, array in ((Role.INPUT_IDS, self.input_ids), (Role.ROPE_COS, self.rope_cos),
                            (Role.ROPE_SIN, self.rope_sin), (Role.ATTENTION_BIAS, self.attention_bias)):
            spec = next((s for s in entry.inputs if s.role is role), None)
            if spec is not None:  # a layer-group part (export/parts.py) takes only what its layers read
                self._binding.bind_input(spec.name, _graph_array(spec, array, quant=family.quant,
                                                                 conversions=self._to_graph))
        if logits is not None:
            self._binding.bind_output(logits.name, _graph_array(logits, self.logits, quant=family.quant,
                                                                conversions=self._from_graph))
        self._bind_local(by_role, family)
        num_kv_heads = family.config.num_kv_heads
        self._kv_inputs, inputs_of = _kv_table(entry.inputs, KV_INPUT_ROLES, num_kv_heads=num_kv_heads)
        self._kv_outputs, outputs_of = _kv_table(entry.outputs, KV_OUTPUT_ROLES, num_kv_heads=num_kv_heads)
        all_tensors = 2 * family.config.num_layers * num_kv_heads
        # a part's rows of the cache's [T, B] address tables (None: every tensor, the whole graph)
        self._kv_rows = [None if len(t) == all_tensors else t for t in (inputs_of, outputs_of)]
        self.bound_kv_inputs: np.ndarray | None = None  # [T, B] addresses of the last bind
        self.bound_kv_outputs: np.ndarray | None = None  # [T, B]

    def bind_hidden(self, arrays: Mapping[str, np.ndarray]) -> None:
        """A layer-group part's residual stream at its cuts (runner.PartRunner)."""
        bind_hidden(self._binding, self.entry, arrays)

    def run(self, kv: KVCache, *, num_real: int, active: np.ndarray | None = None) -> np.ndarray:
        """num_real is not needed: padding rows attend causally like real ones and only their logits differ
        (active neither: every row attends)."""
        past_len, ar = self.shape.past_len, self.shape.ar
        np.add(kv.positions[:, None], self._row_offsets, out=self._positions)
        self._rope.fill(self._positions, cos_out=self.rope_cos, sin_out=self.rope_sin)
        attention_bias(lengths=kv.lengths, past_len=past_len, ar=ar, out=self.attention_bias)
        if self._local_rope is not None:
            self._local_rope.fill(self._positions, cos_out=self.rope_cos_local, sin_out=self.rope_sin_local)
            attention_bias(lengths=kv.local_lengths, past_len=self.local_past_len, ar=ar, window=self._window,
                           out=self.attention_bias_local)
        self._bind_kv(kv.window_addresses(past_len), kv.slot_addresses(ar))
        run_converted(self._binding, to_graph=self._to_graph, from_graph=self._from_graph)
        return self.logits

    def _bind_local(self, by_role: dict, family: FamilyContext) -> None:
        """A model with local layers: their own RoPE rows and a sliding mask over min(P, W-1) past rows."""
        self._local_rope, self._window = None, family.config.local_window
        if not any(s.role is Role.ATTENTION_BIAS_LOCAL for s in self.entry.inputs):
            return
        self._local_rope = family.local_rope
        self.local_past_len = by_role[Role.ATTENTION_BIAS_LOCAL].shape[-1] - self.shape.ar
        self.rope_cos_local = np.zeros(self.rope_cos.shape, np.float32)  # [B, 1, AR, D]
        self.rope_sin_local = np.zeros(self.rope_sin.shape, np.float32)  # [B, 1, AR, D]
        self.attention_bias_local = np.zeros(by_role[Role.ATTENTION_BIAS_LOCAL].shape, np.float32)  # [B,1,AR,Pl+AR]
        for role, array in ((Role.ROPE_COS_LOCAL, self.rope_cos_local), (Role.ROPE_SIN_LOCAL, self.rope_sin_local),
                            (Role.ATTENTION_BIAS_LOCAL, self.attention_bias_local)):
            self._binding.bind_input(by_role[role].name, _graph_array(by_role[role], array, quant=family.quant,
                                                                      conversions=self._to_graph))

    def _bind_kv(self, window_addresses: np.ndarray, slot_addresses: np.ndarray) -> None:
        """Point every past input at its window and every new output at its slot; addresses are [T, B]."""
        rows_in, rows_out = self._kv_rows
        inputs = window_addresses if rows_in is None else window_addresses[rows_in]
        outputs = slot_addresses if rows_out is None else slot_addresses[rows_out]
        self._binding.bind_inputs_at(self._kv_inputs, inputs.ravel().tolist())
        self._binding.bind_outputs_at(self._kv_outputs, outputs.ravel().tolist())
        self.bound_kv_inputs, self.bound_kv_outputs = window_addresses, slot_addresses
