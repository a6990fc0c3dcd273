"""The HTP family's segmented graphs (segment_graph.py): which shapes, their calibration feeds, their pinned
parameters.

Shapes: per batch size, per prompt rung P_prompt (each decode window of the family, S - 1) and per response rung P,
decode (AR = 1) and the smallest verify length. The response buffer is bound whole, so its capacity is a rung
(kv_manager ResponseCache's `rungs`). The rungs are 16 x 4^k and the largest context (16, 64, 256, 1024, 2048 for
the default export): a graph per 16 rows would give 128 rungs per prompt rung, a doubling ladder 8; every graph is
compiled into the family's QNN context, so their number costs compile time and context size, while the response
rows a step reads in vain (fewer than 4x its own, masked) stay small next to the prompt's, which every sequence
shares. Pairs no request can reach within the largest context are left out (38 graphs for the default export, 8
for contexts 32 and 64).

Calibration: the recorded steps (decode tokens and prompt chunks), each split at a row: its older rows are the
prompt segment (left-padded, as the single graphs' windows are), its newest rows (up to P, half the past at most)
the response segment of every sequence. Sequence b's new row is one of the step's tokens at the step's position,
attending to the step's past: a decode step exactly as recorded (in every sequence), a prompt chunk in feeds of B of
its tokens each, every token once (a later token without the chunk rows before it). Decode steps alone would
calibrate on the few tokens the float model itself picked, and clip the activations of any other token's row; the
single graphs' template sees every chunk row.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx

from staticlm.export.calibration.traces import TraceStep, window_rows
from staticlm.export.family import ExportOptions
from staticlm.kv_manager.segments import SEGMENT_STEP
from staticlm.runtime.engine.rope import RopeTable
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, IODtypes, Role, TensorSpec, kv_name, kv_tensor_index
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest, file_sha256
from staticlm.runtime.family.quant_params import FamilyQuant, TensorQuant
from staticlm.runtime.family.segments import static_segment_graph_io

from .qdq import boundary_params
from .segment_graph import FamilyWeights, HTPSegmentGraph
from .template import specialize

RUNG_FACTOR = 4


def response_rungs(max_context: int) -> tuple[int, ...]:
    """16, 64, 256, ... below max_context, then max_context: the response buffer's capacities, each a graph's P."""
    rungs, p = [], SEGMENT_STEP
    while p < max_context:
        rungs.append(p)
        p *= RUNG_FACTOR
    return (*rungs, max_context)


def htp_segment_shapes(options: ExportOptions, *, local_layers: bool) -> list[tuple[str, GraphShape, int]]:
    """(name, shape, P_prompt) of every segmented graph; empty without batch sizes or with local layers."""
    if local_layers:
        return []
    contexts = sorted(set(options.contexts))
    max_context = contexts[-1]
    # decode, and the smallest verify length for BASS-PAD (its drafts are cut to fit: batch_speculative.py); more
    # verify lengths would multiply the graphs again
    ars = (1, *sorted(options.verify_lens)[:1])
    out = []
    for b in sorted(set(options.batch_sizes)):
        for ar in ars:
            smallest_prompt = 1  # the fewest prompt rows a prompt rung serves
            for s in contexts:
                rows_before = 0  # a rung is reached at more response rows than the one below holds
                for p in response_rungs(max_context):
                    if smallest_prompt + rows_before + ar <= max_context:
                        name = f"segment_s{s}_p{p}_b{b}" if ar == 1 else f"segment_s{s}_p{p}_ar{ar}_b{b}"
                        out.append((name, GraphShape(b, ar, p), s - 1))
                    rows_before = p
                smallest_prompt = s
    return out


def segment_pinned(specs: tuple[TensorSpec, ...], fq: FamilyQuant, *, config: ModelConfig) -> dict[str, TensorQuant]:
    """The graph's boundary parameters, plus each head's batched new K/V (the compute ops the outputs are split from)
    pinned to that tensor's KV parameters."""
    out = boundary_params(specs, fq, num_kv_heads=config.num_kv_heads)
    for layer in range(config.num_layers):
        for h in range(config.num_kv_heads):
            for role, is_value in ((Role.NEW_KEY, False), (Role.NEW_VALUE, True)):
                out[kv_name(role, layer, h)] = fq.kv[kv_tensor_index(layer=layer, kv_head=h, is_value=is_value,
                                                                     num_kv_heads=config.num_kv_heads)]
    return out


class SegmentStepFeeds:
    """Recorded decode steps as feeds of one segmented graph shape (see the module docstring)."""

    def __init__(self, shape: GraphShape, *, prompt_len: int, config: ModelConfig, mask_value: float) -> None:
        self.shape, self.prompt_len, self.mask_value = shape, prompt_len, mask_value
        self._rope = RopeTable(config)
        hkv = config.num_kv_heads
        self._kv = [(layer, h, is_value, kv_tensor_index(layer=layer, kv_head=h, is_value=is_value, num_kv_heads=hkv))
                    for layer in range(config.num_layers) for h in range(hkv) for is_value in (False, True)]

    def select(self, steps: tuple[TraceStep, ...]) -> tuple[TraceStep, ...]:
        """Steps with a past (a one-row past is all prompt, the response rows all masked)."""
        return tuple(s for s in steps if s.past.shape[1] >= 1)

    def feeds(self, step: TraceStep, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """tokens [B]: each sequence's new row."""
        s, pp = self.shape, self.prompt_len
        b, p, n = s.batch, s.past_len, step.past.shape[1]
        r = min(p, n // 2)  # response rows (0 for a one-row past)
        prompt = window_rows(step.past[:, :n - r], pp)  # [T, m, D]
        m = prompt.shape[1]
        ids = tokens[:, None].astype(np.int64)  # [B, 1]
        cos = np.zeros((b, 1, 1, step.past.shape[2]), np.float32)
        sin = np.zeros_like(cos)
        self._rope.fill(np.full((b, 1), step.position, np.int64), cos_out=cos, sin_out=sin)
        bias = np.full((b, 1, 1, pp + p + 1), self.mask_value, np.float32)  # [B, 1, AR, Pp + P + AR]
        bias[..., pp - m:pp] = 0
        bias[..., pp:pp + r] = 0
        bias[..., -1] = 0
        feeds = {"input_ids": ids, "rope_cos": cos, "rope_sin": sin, "attention_bias": bias}
        for layer, h, is_value, t in self._kv:
            window = np.zeros((1, 1, pp, prompt.shape[2]), np.float32)  # [1, 1, Pp, D], left padding
            window[0, 0, pp - m:] = prompt[t]
            buffer = np.zeros((b, 1, p, prompt.shape[2]), np.float32)  # [B, 1, P, D], valid rows first
            buffer[:, 0, :r] = step.past[t, n - r:]
            feeds[kv_name(Role.PROMPT_VALUE if is_value else Role.PROMPT_KEY, layer, h)] = window
            feeds[kv_name(Role.PAST_VALUE if is_value else Role.PAST_KEY, layer, h)] = buffer
        return feeds

    def iterate(self, steps: tuple[TraceStep, ...]):
        b = self.shape.batch
        for step in self.select(steps):
            for start in range(0, step.token_ids.size, b):  # the last feed repeats its last token in spare rows
                part = step.token_ids[start:start + b]
                yield self.feeds(step, np.concatenate([part, np.repeat(part[-1:], b - part.size)]))


def export_segment_graphs(float_dir: Path, final: Path, fm: Manifest, *, shapes: list[tuple[str, GraphShape, int]],
                          fq: FamilyQuant, dtypes: IODtypes, config: ModelConfig, quantize,
                          on_step=lambda _name: None) -> list[GraphEntry]:
    """Build the float segmented graphs into float_dir (over its weights), quantize the smallest as the template
    (`quantize(entry, feeds, pinned)`: family.py's template pass), specialize it onto every shape into final."""
    if not shapes:
        return []
    decode = fm.graphs_of(GraphKind.DECODE)[0]
    weights = FamilyWeights(onnx.load(str(float_dir / decode.file), load_external_data=False))
    floats = {}
    for name, shape, prompt_len in shapes:
        proto = HTPSegmentGraph(config, shape, prompt_len=prompt_len, weights=weights).build(name)
        onnx.save_model(proto, float_dir / f"{name}.onnx")
        inputs, outputs = static_segment_graph_io(config, shape, prompt_len=prompt_len)
        floats[name] = (GraphEntry(name=name, file=f"{name}.onnx", kind=GraphKind.SEGMENT, shape=shape,
                                   inputs=inputs, outputs=outputs, sha256=""), prompt_len, proto)
    name, shape, prompt_len = min(shapes, key=lambda x: (x[1].ar, x[2], x[1].past_len, -x[1].batch))  # template
    entry = floats[name][0]
    feeds = SegmentStepFeeds(shape, prompt_len=prompt_len, config=config, mask_value=fq.mask_value)
    template = quantize(entry, feeds, segment_pinned(entry.inputs + entry.outputs, fq, config=config))
    on_step("segment template")
    out = []
    for entry, prompt_len, float_proto in floats.values():
        proto = specialize(template.proto, template.float_proto, float_proto)
        onnx.save_model(proto, final / entry.file)
        inputs, outputs = static_segment_graph_io(config, entry.shape, prompt_len=prompt_len, dtypes=dtypes)
        out.append(dataclasses.replace(entry, inputs=inputs, outputs=outputs, sha256=file_sha256(final / entry.file)))
        on_step(entry.name)
    return out
