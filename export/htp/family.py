"""`export --target htp`: the quantized family (QDQ graphs, integer KV/mask/rope/logits I/O, one weight file).

Pipeline: export the float family to a scratch directory, record real decoding traces with it, derive the
family-wide boundary parameters from those traces, quantize ONE template graph with ONNX Runtime's QNN
tooling (boundary tensors pinned, calibrated on every recorded step), strip its boundary Q/DQ, move its
quantized weights into the family's one weight file, and specialize it to every shape (template.py).
The same template with its activation parameters calibrated on first tokens only gives the sink graph
(see export/calibration/traces.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from staticlm.export.calibration.groups import Group, split_template
from staticlm.export.calibration.streamed import record_traces_streamed
from staticlm.export.calibration.traces import (
    StepFeeds,
    Traces,
    calibration_prompts,
    record_traces,
    template_entry,
    trace_reader,
)
from staticlm.export.family import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ExportError,
    ExportOptions,
    export_family,
    staged_family,
    staging_dir,
)
from staticlm.export.gptq.calibrated import round_on_traces
from staticlm.export.graph.htp_grids import ProjectionGrids, projection_sources
from staticlm.export.htp.options import QuantOptions
from staticlm.export.sources import LoadedModel
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import IODtypes, graph_io
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest, file_sha256
from staticlm.runtime.family.quant_params import FamilyQuant, Quant, TensorQuant
from staticlm.runtime.model import chat_format
from staticlm.runtime.text.chat_template import Message

from . import gptq
from .blocks import grid_overrides, to_block_weights
from .groups import group_ranges, quantize_groups
from .kv_only import add_kv_boundary
from .memory import ExportSize, check_memory, export_size, out_of_memory
from .plan import GraphPlan
from .qdq import (
    Ranges,
    boundary_params,
    calibrated_ranges,
    quantize_graph,
    recalibrated,
    signed_matmul_operands,
    strip_boundary,
    through_data_movement,
)
from .segment_export import export_segment_graphs, htp_segment_shapes
from .template import specialize

CALIB_NEW_TOKENS = 24  # greedy tokens per calibration prompt: decode steps at growing lengths
INLINE_LIMIT = 1024  # bytes; smaller initializers (activation scales, shapes) stay inside each graph


# Calibration sees a few hundred steps; text it never saw reaches past their ranges, and a clipped K or V
# row is wrong by the whole overshoot in every later step. Headroom trades resolution for coverage: 2x costs
# one of 16 bits, 1.25x a third of one of 8 bits. The same holds for logits, where a clipped top logit changes
# the argmax.
KV_HEADROOM = {"uint16": 2.0, "uint8": 1.25}
LOGITS_HEADROOM = 1.5


def _widened(lo: float, hi: float, factor: float) -> tuple[float, float]:
    return lo * factor if lo < 0 else lo, hi * factor if hi > 0 else hi


def family_quant(traces: Traces, quant: QuantOptions, *, rope_bound: float = 1.0) -> FamilyQuant:
    """Boundary parameters from the traces: KV per tensor from the union of past and new ranges. rope_bound: the
    largest |cos|, |sin| (longrope's attention factor scales them past 1)."""
    dtype = quant.kv_bits.dtype
    kv = tuple(TensorQuant.from_range(*_widened(lo, hi, KV_HEADROOM[dtype]), dtype)
               for lo, hi in zip(traces.kv_min, traces.kv_max))
    if quant.quant is Quant.KV_ONLY:
        return FamilyQuant(quant=quant.quant, kv=kv)
    logits = _widened(traces.logits_min, traces.logits_max, LOGITS_HEADROOM)
    return FamilyQuant(quant=quant.quant, kv=kv, rope=TensorQuant.from_range(-rope_bound, rope_bound, "uint16"),
                       mask=TensorQuant.from_range(quant.mask_value, 0.0, "uint16"),
                       logits=TensorQuant.from_range(*logits, "uint16"), mask_value=quant.mask_value)


def io_dtypes(fq: FamilyQuant) -> IODtypes:
    f = "float32"
    return IODtypes(kv=fq.kv_dtype, rope=fq.rope.dtype if fq.rope else f, mask=fq.mask.dtype if fq.mask else f,
                    logits=fq.logits.dtype if fq.logits else f)


def _projection_weights(config) -> list[str]:
    """The [in, out] MatMul weights of export/graph/htp_style.py, quantized per output channel (axis 1)."""
    names = []
    for layer in range(config.num_layers):
        names += [f"l{layer}.q", f"l{layer}.o", f"l{layer}.gate_up", f"l{layer}.down"]
        names += [f"l{layer}.{kind}_h{h}" for kind in ("k", "v") for h in range(config.num_kv_heads)]
    return names


def _norm_weights(config) -> list[str]:
    kinds = (("attn_norm", "mlp_norm") + (("q_norm", "k_norm") if config.qk_norm else ())
             + (("attn_post_norm", "mlp_post_norm") if config.sandwich_norms else ()))
    return ["final_norm"] + [f"l{layer}.{n}" for layer in range(config.num_layers) for n in kinds]


def weight_overrides(quant: Quant, config) -> dict[str, list[dict]]:
    """Per-channel projection weights (one scale per output column): one outlier column no longer coarsens
    the whole matrix (per-tensor 8-bit weights cost SmolLM2 much of its top-1 agreement). The embedding
    is per-tensor (QNN's Gather reads one scale), so it takes 16 bits (below)."""
    from onnxruntime.quantization import QuantType

    # Symmetric signed: QNN HTP takes per-channel MatMul weights only with zero offsets (asymmetric uint8
    # per-channel failed validation, "Failed to add fused Matmul node", and ran on the CPU EP).
    qtype = QuantType.QInt8 if quant is Quant.W8A16 else QuantType.QInt4
    out = {n: [{"quant_type": qtype, "symmetric": True, "axis": 1}] for n in _projection_weights(config)}
    # The head is the single most sensitive weight: an 8-bit head costs SmolLM2 w8a16 agreement with float that a
    # 16-bit one does not (tests/test_htp.py::test_smollm2_w8a16_agreement). HTP runs the 16 x 16-bit MatMul
    # (checked on the emulator with CPU fallback off); it costs V x hidden more bytes (28 MB for SmolLM2).
    out["lm_head_t"] = [{"quant_type": QuantType.QInt16, "symmetric": True, "axis": 1}]  # under w4a16 too
    # One scale over the whole table leaves 8 bits too coarse for most rows: a 16-bit table agrees with float
    # better (+V x hidden bytes, of which a token reads one row).
    out["embed"] = [{"quant_type": QuantType.QUInt16, "symmetric": False}]
    # RMSNorm scales span orders of magnitude across channels; 8 bits per tensor flatten the small ones.
    # They are a few KB: keep them 16-bit.
    for name in _norm_weights(config):
        out[name] = [{"quant_type": QuantType.QUInt16, "symmetric": False}]
    return out


class _SharedInitializers:
    """Moves a graph's large initializers into the family's weight file, each name once."""

    def __init__(self, writer: WeightFileWriter) -> None:
        self.writer, self._sha = writer, {}
        self._pending: dict[str, tuple] = {}  # tables.py's tables, written in absorb's order

    def write_table(self, name: str, dtype, shape: tuple[int, ...], blocks, key: str) -> onnx.TensorProto:
        """A table quantized block by block (tables.py), written into the file once when absorb reaches it (the
        file's order stays the graph's); key: its parameters, which every graph reading it must share."""
        if name in self._sha and self._sha[name] != key:
            raise ExportError(f"initializer {name} differs between graphs of one family")
        self._pending[name] = (dtype, shape, blocks, key)
        proto = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        proto.dims.extend(shape)
        return proto

    def absorb(self, model: onnx.ModelProto) -> None:
        for i, init in enumerate(model.graph.initializer):
            if init.name in self._pending:
                dtype, shape, blocks, key = self._pending.pop(init.name)
                if init.name not in self._sha:
                    self.writer.add_blocks(init.name, dtype, shape, blocks)
                    self._sha[init.name] = key
                model.graph.initializer[i].CopyFrom(self.writer.proto(init.name))
                continue
            raw = init.raw_data
            if len(raw) < INLINE_LIMIT:
                continue
            sha = hashlib.sha256(raw).hexdigest()
            if init.name not in self._sha:
                self.writer.add(init.name, np.frombuffer(raw, np.uint8))
                self._sha[init.name] = sha
            elif self._sha[init.name] != sha:  # the same weight must quantize identically in every graph
                raise ExportError(f"initializer {init.name} differs between graphs of one family")
            proto = self.writer.proto(init.name)
            proto.data_type = init.data_type  # the bytes were written raw (4-bit types stay packed)
            del proto.dims[:]
            proto.dims.extend(init.dims)
            model.graph.initializer[i].CopyFrom(proto)


def _prompt_ids(float_dir: Path, prompts: list[str]) -> tuple[list[list[int]], tuple[int, ...], tuple[int, ...]]:
    """Chat-template prompt ids, the EOS ids, and the first token of each bare prompt (varied sink steps)."""
    fmt = chat_format(float_dir)
    bare = sorted({fmt.tokenizer.encode(p, add_special_tokens=False)[0] for p in prompts if p})
    return ([fmt.prompt_ids([Message(role="user", content=p)]) for p in prompts], fmt.tokenizer.eos_token_ids,
            tuple(bare))


@dataclasses.dataclass(frozen=True)
class _Template:
    proto: onnx.ModelProto  # quantized, integer boundary, weights in the family's file
    float_proto: onnx.ModelProto  # the float graph it was made from (no weights loaded)
    ranges: Ranges  # the activation ranges it was calibrated with
    pinned: dict[str, TensorQuant]  # tensors whose parameters are the family's (boundary, through data movement)
    groups: tuple[Group, ...] = ()  # its float layer groups (groups.py); none: quantized whole


def _step_feeds(fm: Manifest, *, fq: FamilyQuant, config) -> StepFeeds:
    entry = template_entry(fm.graphs)
    return StepFeeds(entry.inputs, entry.shape, config=config, mask_value=fq.mask_value)


def _step_reader(fm: Manifest, steps, *, fq: FamilyQuant, config):
    return trace_reader(_step_feeds(fm, fq=fq, config=config), steps)


def _gptq_overrides(float_dir: Path, fm: Manifest, steps, *, fq: FamilyQuant, config,
                    grids: ProjectionGrids) -> dict[str, list[dict]]:
    """GPTQ-round the 8-bit projection weights in the scratch float family's weight file (gptq.py)."""
    from onnxruntime.quantization import QuantType

    path = float_dir / template_entry(fm.graphs).file
    weights = [w for w in _projection_weights(config) if w not in grids]  # a grid is kept as the source has it
    if not weights:
        return {}
    feeds = _step_feeds(fm, fq=fq, config=config)
    real_rows = ((feeds.feeds(s), min(s.token_ids.size, feeds.shape.ar)) for s in feeds.select(steps))
    return gptq.round_weights(path, float_dir / WEIGHTS_FILE, real_rows, weights=weights, qtype=QuantType.QInt8)


def _quantized_template(float_dir: Path, fm: Manifest, *, work: Path, steps, fq: FamilyQuant,
                        quant: QuantOptions, config, shared: _SharedInitializers,
                        rounded: dict[str, list[dict]] | None = None,
                        grids: ProjectionGrids | None = None, entry: GraphEntry | None = None, feeds=None,
                        pinned: dict | None = None, drop_pages: Callable[[], None] = lambda: None) -> _Template:
    """A quantizer pass over the template graph (see template.py), calibrated on the recorded steps, one layer group
    at a time (groups.py; quant.max_group_bytes None: the whole graph at once); grids: the projections that keep the
    source's grid (none when not given). entry, feeds, pinned: another template (the segmented graphs':
    segment_export.py), its step feeds and its pinned parameters. drop_pages: the source's (LoadedModel)."""
    entry = entry or template_entry(fm.graphs)
    if pinned is None:
        pinned = boundary_params(entry.inputs + entry.outputs, fq, num_kv_heads=config.num_kv_heads)
    feeds = feeds if feeds is not None else _step_feeds(fm, fq=fq, config=config)
    float_proto = onnx.load(str(float_dir / entry.file), load_external_data=False)
    grids = ProjectionGrids(config, {}) if grids is None else grids
    overrides = {**weight_overrides(quant.quant, config), **grid_overrides(grids, float_proto), **(rounded or {})}
    # 4-bit weights of a float source go per block too: one 4-bit scale per channel costs far more agreement
    # with float than one per block. 8-bit ones stay per channel, GPTQ-rounded (`rounded`).
    four_bit = quant.quant is Quant.W4A16
    float_blocks = frozenset(set(_projection_weights(config)) - set(grids.names())) if four_bit else frozenset()

    def finish(proto: onnx.ModelProto, float_graph: onnx.ModelProto) -> None:
        to_block_weights(proto, float_graph, float_dir / WEIGHTS_FILE, grids=grids, float_blocks=float_blocks)
        shared.absorb(proto)
        drop_pages()  # the source's grids this group read

    through = through_data_movement(float_dir / entry.file, pinned)
    if quant.max_group_bytes is None:
        qpath = work / "q" / entry.file
        qpath.parent.mkdir()
        ranges = quantize_graph(float_dir / entry.file, qpath, reader=trace_reader(feeds, steps), quant=quant.quant,
                                pinned=pinned, weight_overrides=overrides)
        proto = signed_matmul_operands(strip_boundary(onnx.load(str(qpath), load_external_data=True), pinned))
        finish(proto, float_proto)
        shutil.rmtree(qpath.parent)
        return _Template(proto=proto, float_proto=float_proto, ranges=ranges, pinned=through)
    kv_layer = {s.name: s.layer for s in (*entry.inputs, *entry.outputs) if s.layer is not None}
    groups = split_template(float_dir / entry.file, kv_layer=kv_layer, num_layers=config.num_layers,
                            hidden_size=config.hidden_size, max_bytes=quant.max_group_bytes)
    proto, ranges = quantize_groups(groups, lambda: feeds.iterate(steps), order=float_proto.graph, work=work,
                                    quant=quant.quant, pinned=pinned, weight_overrides=overrides, finish=finish,
                                    weights=float_dir / WEIGHTS_FILE, write_table=shared.write_table)
    return _Template(proto=proto, float_proto=float_proto, ranges=ranges, pinned=through, groups=tuple(groups))


def _sink_template(template: _Template, float_dir: Path, fm: Manifest, steps, *, fq: FamilyQuant,
                   config) -> _Template:
    """The template with its activation parameters calibrated on first tokens only (calibration/traces.py), one
    layer group at a time when the template was quantized so."""
    names = sorted(template.ranges)
    if template.groups:
        feeds = _step_feeds(fm, fq=fq, config=config)
        ranges = group_ranges(list(template.groups), lambda: feeds.iterate(steps), names, fixed=template.pinned)
    else:
        ranges = calibrated_ranges(float_dir / template_entry(fm.graphs).file,
                                   _step_reader(fm, steps, fq=fq, config=config), names)
    proto = recalibrated(template.proto, calibrated=template.ranges, ranges=ranges, pinned=frozenset(template.pinned))
    proto = signed_matmul_operands(proto)  # int16 copies follow the new ranges
    return dataclasses.replace(template, proto=proto, ranges=ranges)


def _sink_graph(sink: _Template, fm: Manifest, float_dir: Path, final: Path, *, dtypes: IODtypes,
                config) -> GraphEntry:
    """The sink pass at the smallest decode graph's shape: the first token of a sequence runs there alone."""
    decode = fm.graphs_of(GraphKind.DECODE)[0]
    proto = specialize(sink.proto, sink.float_proto, onnx.load(str(float_dir / decode.file), load_external_data=False))
    file = f"sink_{decode.file}"
    onnx.save_model(proto, final / file)
    inputs, outputs = graph_io(config, decode.shape, dtypes=dtypes)
    return GraphEntry(name=f"sink_{decode.name}", file=file, kind=GraphKind.SINK, shape=decode.shape,
                      inputs=inputs, outputs=outputs, sha256=file_sha256(final / file))


@contextlib.contextmanager
def _scratch(out_dir: Path):
    """The float family and the quantizer's files, removed when the export ends however it ends."""
    work = staging_dir(out_dir, kind="q.")
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def export_quantized_family(model: LoadedModel, out_dir: str | Path, *, quant: QuantOptions,
                            plan: GraphPlan | None = None, options: ExportOptions | None = None,
                            prompts: list[str] | None = None, on_step: Callable[[str], None] | None = None) -> Manifest:
    """Write the quantized family of plan's graphs (or of every shape options name) into out_dir atomically; returns
    its manifest."""
    plan = plan or (GraphPlan.of_options(options) if options else GraphPlan.default_for(model.config.max_positions))
    options = plan.float_options()
    plan.check(num_segment_graphs=len(htp_segment_shapes(options, local_layers=bool(model.config.local_layers))))
    size = _export_size(model, options, quant)
    try:
        return _export(model, out_dir, plan=plan, quant=quant, prompts=prompts, on_step=on_step, size=size)
    except MemoryError:  # numpy's or onnxruntime's allocation failed: nothing written (staged_family)
        raise out_of_memory(size, streamed=_streamed(model, quant)) from None


def _streamed(model: LoadedModel, quant: QuantOptions) -> bool:
    """One layer group in memory at a time: by groups, and no GPTQ over the whole float model (a float source's
    projections, gptq.py and gptq/calibrated.py; a GGUF's grids are kept, never rounded again)."""
    rounds = quant.quant is Quant.W8A16 or quant.block_gptq is not None
    every_grid = all(hf in model.grids for parts in projection_sources(model.config).values() for hf, _ in parts)
    return quant.max_group_bytes is not None and (every_grid or not rounds)


def _export_size(model: LoadedModel, options: ExportOptions, quant: QuantOptions) -> ExportSize:
    """From the shapes alone: the template's window (the smallest context's prefill graph), the steps kept (the
    calibration steps, the long conversation re-read in chunks, the sink steps)."""
    num_prompts = len(calibration_prompts())
    max_context = max(options.contexts)
    return export_size(model.config, max_group_bytes=quant.max_group_bytes,
                       num_steps=quant.calib_steps + max_context // options.prefill_len + 2 * num_prompts,
                       window_rows=min(options.contexts) - options.prefill_len, max_context=max_context)


def _export(model: LoadedModel, out_dir: str | Path, *, plan: GraphPlan, quant: QuantOptions,
            prompts: list[str] | None, on_step: Callable[[str], None] | None, size: ExportSize) -> Manifest:
    config, out_dir, options = model.config, Path(out_dir), plan.float_options()
    segment_shapes = htp_segment_shapes(options, local_layers=bool(config.local_layers))
    options = dataclasses.replace(options, htp_style=True, batch_sizes=())  # see export/graph/htp_style.py
    options.validate(config.max_positions)
    config = config.for_context(max(options.contexts))  # longrope's set; a sliding window checked
    check_memory(size, streamed=_streamed(model, quant))  # before anything is written
    step = on_step or (lambda _name: None)
    with staged_family(out_dir) as final, _scratch(out_dir) as work:
        run = _Run(float_dir=work / "float", work=work, final=final, quant=quant, options=options, config=config,
                   step=step)
        fm, num_prompts, traces = _float_family_traces(model, run, prompts=prompts or calibration_prompts())
        fq = family_quant(traces, quant, rope_bound=config.rope_attention_factor)
        if quant.quant is Quant.KV_ONLY:  # float weights, unchanged: the float family's file as it is
            shutil.copyfile(run.float_dir / WEIGHTS_FILE, final / WEIGHTS_FILE)
            entries = _plan_graphs(run, plan, fm, template=None, fq=fq)
            weights = fm.weights_bytes, fm.weights_sha256
            rounding = None
        else:
            quantized = _quantize(model, fm, run, traces=traces, fq=fq)
            fm, rounding = quantized.fm, quantized.rounding
            entries = _plan_graphs(run, plan, fm, template=quantized.template, fq=fq)
            entries += _sink_and_segment_graphs(run, quantized, traces=traces, fq=fq, segment_shapes=segment_shapes)
            weights = quantized.writer.close()
        shutil.copyfile(run.float_dir / TOKENIZER_FILE, final / TOKENIZER_FILE)
        manifest = Manifest(
            model=config, graphs=tuple(entries), weights_file=WEIGHTS_FILE, weights_bytes=weights[0],
            weights_sha256=weights[1], tokenizer_file=TOKENIZER_FILE, chat_template=fm.chat_template,
            special_tokens=fm.special_tokens, kv_dtype=fq.kv_dtype, quantization=fq.to_dict(), source=fm.source,
            generation_defaults=fm.generation_defaults,
            extra={"target": "htp", "calib_steps": len(traces.steps), "calib_prompts": num_prompts,
                   **({"weight_rounding": rounding} if rounding else {})})
        manifest.save(final)
        step("manifest")
    return manifest


@dataclasses.dataclass(frozen=True)
class _Run:
    """One export's places and settings, which its stages share."""

    float_dir: Path  # the float family, in the scratch directory
    work: Path  # the scratch directory (the quantizer's files)
    final: Path  # the staged family
    quant: QuantOptions
    options: ExportOptions  # the float family's
    config: ModelConfig
    step: Callable[[str], None]


def _float_family_traces(model: LoadedModel, run: _Run, *, prompts: list[str]) -> tuple[Manifest, int, Traces]:
    """The float family written into the scratch directory, and its decoding traces on the prompts; returns its
    manifest, the number of prompts and the traces."""
    fm = export_family(model, run.float_dir, options=run.options)
    model.drop_pages()  # the source's file, read whole for the float family
    run.step("float family")
    ids, eos, first_tokens = _prompt_ids(run.float_dir, prompts)
    record = dict(max_steps=run.quant.calib_steps, max_new_tokens=CALIB_NEW_TOKENS, eos_ids=eos,
                  sink_ids=first_tokens, on_prompt=lambda: run.step("calibration trace"),
                  max_past_rows=template_entry(fm.graphs).shape.past_len)
    if run.quant.max_group_bytes is None:  # the whole float family through the Engine
        traces = record_traces(run.float_dir, ids, **record)
    else:
        traces = record_traces_streamed(run.float_dir, fm, ids, max_bytes=run.quant.max_group_bytes, **record)
    return fm, len(ids), traces


@dataclasses.dataclass(frozen=True)
class _Quantized:
    """What every quantized graph of a family shares."""

    model: LoadedModel  # the source (its 4-bit projections on GPTQ block grids where block_gptq rounded them)
    fm: Manifest  # the float family (written again on those grids)
    rounding: dict | None  # how block_gptq rounded them, for the manifest
    writer: WeightFileWriter  # the family's weight file
    shared: _SharedInitializers
    grids: ProjectionGrids  # the projections that keep the source's grid
    rounded: dict[str, list[dict]] | None  # the 8-bit projections' GPTQ-rounded weights
    template: _Template
    sink: _Template


def _quantize(model: LoadedModel, fm: Manifest, run: _Run, *, traces: Traces, fq: FamilyQuant) -> _Quantized:
    """The family's weight file opened, the projections rounded (a float source's 4-bit ones onto GPTQ block grids,
    the 8-bit ones by per-channel GPTQ), then the template quantized and the sink template calibrated from it."""
    quant, config, step = run.quant, run.config, run.step
    writer = WeightFileWriter(run.final / WEIGHTS_FILE)
    shared = _SharedInitializers(writer)
    rounding = None
    if quant.block_gptq is not None:  # a float source's 4-bit projections onto GPTQ block grids
        model, rounding = round_on_traces(model, run.float_dir, fm, traces.family_steps + traces.replay_steps,
                                          mask_value=fq.mask_value, options=quant.block_gptq, step=step)
        if rounding is not None:
            fm = export_family(model, run.float_dir, options=run.options)  # the float family on those grids
        step("float family on the rounded grids")
    # Per-channel GPTQ is w8a16 only: per channel, w4a16 agreed with float less well with it (each layer's
    # own output error fell, but 4-bit layers fed the next ones inputs far from the float ones it is fit to)
    grids = ProjectionGrids(config, model.grids, eight_bit=quant.quant is Quant.W8A16)
    rounded = (_gptq_overrides(run.float_dir, fm, traces.family_steps + traces.replay_steps, fq=fq, config=config,
                               grids=grids) if quant.quant is Quant.W8A16 else None)
    step("GPTQ")
    template = _quantized_template(run.float_dir, fm, work=run.work, steps=traces.family_steps, fq=fq, quant=quant,
                                   config=config, shared=shared, rounded=rounded, grids=grids,
                                   drop_pages=model.drop_pages)
    sink = _sink_template(template, run.float_dir, fm, traces.sink_steps, fq=fq, config=config)
    step("quantized template")
    return _Quantized(model=model, fm=fm, rounding=rounding, writer=writer, shared=shared, grids=grids,
                      rounded=rounded, template=template, sink=sink)


def _plan_graphs(run: _Run, plan: GraphPlan, fm: Manifest, *, template: _Template | None,
                 fq: FamilyQuant) -> list[GraphEntry]:
    """The plan's graphs of the float family: the template specialized to each one's shape, or (template None, KV
    only) the float graph with its KV boundary made integer."""
    entries = []
    for entry in filter(plan.keeps, fm.graphs):
        pinned = boundary_params(entry.inputs + entry.outputs, fq, num_kv_heads=run.config.num_kv_heads)
        float_proto = onnx.load(str(run.float_dir / entry.file), load_external_data=False)
        if template is None:
            proto = add_kv_boundary(float_proto, pinned)
        else:
            proto = specialize(template.proto, template.float_proto, float_proto)
        onnx.save_model(proto, run.final / entry.file)
        inputs, outputs = graph_io(run.config, entry.shape, dtypes=io_dtypes(fq))
        entries.append(GraphEntry(name=entry.name, file=entry.file, kind=entry.kind, shape=entry.shape,
                                  inputs=inputs, outputs=outputs, sha256=file_sha256(run.final / entry.file)))
        run.step(entry.name)
    return entries


def _sink_and_segment_graphs(run: _Run, quantized: _Quantized, *, traces: Traces, fq: FamilyQuant,
                             segment_shapes) -> list[GraphEntry]:
    """The sink graph, then the segmented graphs (each kind quantized from a template of its own,
    segment_export.py, with the family's weights)."""
    q = quantized
    entries = [_sink_graph(q.sink, q.fm, run.float_dir, run.final, dtypes=io_dtypes(fq), config=run.config)]
    run.step("sink graph")

    def quantize(entry: GraphEntry, feeds, pinned) -> _Template:
        return _quantized_template(run.float_dir, q.fm, work=run.work, steps=traces.family_steps, fq=fq,
                                   quant=run.quant, config=run.config, shared=q.shared, rounded=q.rounded,
                                   grids=q.grids, entry=entry, feeds=feeds, pinned=pinned,
                                   drop_pages=q.model.drop_pages)
    return entries + export_segment_graphs(run.float_dir, run.final, q.fm, shapes=segment_shapes, fq=fq,
                                           dtypes=io_dtypes(fq), config=run.config, on_step=run.step,
                                           quantize=quantize)


def num_quant_steps(options: ExportOptions, num_prompts: int, quant: Quant) -> int:
    # float family, one per prompt trace, GPTQ and the sink graph (not for KV only), the template, each graph
    # (the HTP family's batched graphs are segmented: their template and each of them), manifest
    quantized = quant is not Quant.KV_ONLY
    num_graphs = len(dataclasses.replace(options, batch_sizes=()).shapes()) + quantized
    segments = len(htp_segment_shapes(options, local_layers=False)) if quantized else 0
    return 1 + num_prompts + quantized + 1 + num_graphs + segments + bool(segments) + 1
