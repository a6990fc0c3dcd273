"""Export the `--target cpu` family: MatMulNBits graphs, one file per (batch, AR), one shared weight file.

The manifest still lists one entry per rung of the ladder (same names and static shapes as the float
family, so every consumer binds exactly as before); entries of one (batch, AR) point at the same graph
file, whose past length is symbolic. The manifest's `dynamic_past` tells the runtime it may also run any other
past length (the BMC ladder's finer rungs) through that file.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

from staticlm.export.family import TOKENIZER_FILE, WEIGHTS_FILE, ExportOptions, special_tokens, staged_family
from staticlm.export.gptq.traces import calibrated_rounding
from staticlm.export.sources import LoadedModel
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.contract import GraphShape, graph_io, in_place_graph_io
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest, file_sha256

from .graph import CpuAttention, CpuLlamaGraph, CpuOptions, custom_ops, rows_alone, write_cpu_weights
from .segment_attention import export_segment_graphs, segment_shapes, segments_supported

TARGET = "cpu"


IN_PLACE_FILE = "in_place.onnx"  # every decode, prompt-chunk, verify and batched shape of a gqa family


def graph_file(kind: GraphKind, shape: GraphShape, *, cpu: CpuOptions) -> str:
    """One file serves every in-place shape (its batch and rows are symbolic, so one session, one set of packed
    weights); the windows layout keeps one per (batch, AR)."""
    if cpu.attention is CpuAttention.GQA:
        return IN_PLACE_FILE
    batch = f"_b{shape.batch}" if shape.batch > 1 else ""
    return f"{kind.value}_ar{shape.ar}{batch}.onnx"


def export_cpu_family(model: LoadedModel, out_dir: str | Path, *, options: ExportOptions | None = None,
                      cpu: CpuOptions | None = None, on_step: Callable[[str], None] | None = None) -> Manifest:
    """Write the family into out_dir atomically (see family.staged_family)."""
    config, options, cpu = model.config, options or ExportOptions(), cpu or CpuOptions()
    options.validate(config.max_positions)
    config = config.for_context(max(options.contexts))  # longrope's set; a sliding window checked
    options = options.for_config(config)
    step = on_step or (lambda _name: None)
    rounding = None
    if cpu.gptq is not None and cpu.bits == 4:
        with tempfile.TemporaryDirectory(prefix=f".{Path(out_dir).name}.calib.", dir=Path(out_dir).parent) as tmp:
            model, rounding = calibrated_rounding(model, Path(tmp), options=options, gptq=cpu.gptq,
                                                  calib_steps=cpu.calib_steps, step=step)
    with staged_family(out_dir) as work:
        writer = WeightFileWriter(work / WEIGHTS_FILE)
        plans = write_cpu_weights(config, model, writer, cpu,
                                  on_layer=lambda i: step(f"weights of layer {i + 1}/{config.num_layers}"))
        weights_bytes, weights_sha = writer.close()
        step("weights")
        shapes = options.shapes()
        largest: dict[str, tuple[GraphKind, GraphShape]] = {}
        for _name, kind, shape in shapes:  # each file is built at its largest window (any P up to it runs)
            file = graph_file(kind, shape, cpu=cpu)
            if file not in largest or shape.past_len > largest[file][1].past_len:
                largest[file] = (kind, shape)
        hashes = {}
        for file, (kind, shape) in largest.items():
            last_only = _last_logits_only(cpu=cpu, kind=kind, shape=shape, prefill_len=options.prefill_len)
            proto = CpuLlamaGraph(config, shape, weights=writer, options=cpu, plans=plans,
                                  last_logits_only=last_only).build(Path(file).stem)
            onnx.save_model(proto, work / file)
            hashes[file] = file_sha256(work / file)
            step(file)
        entries = []
        for name, kind, shape in shapes:
            last_only = _last_logits_only(cpu=cpu, kind=kind, shape=shape, prefill_len=options.prefill_len)
            inputs, outputs = (in_place_graph_io(config, shape, last_logits_only=last_only, kv_dtype=cpu.kv_dtype)
                               if cpu.attention is CpuAttention.GQA else graph_io(config, shape))
            file = graph_file(kind, shape, cpu=cpu)
            entries.append(GraphEntry(name=name, file=file, kind=kind, shape=shape, inputs=inputs, outputs=outputs,
                                      sha256=hashes[file]))
        # segment KV for several responses: the prompt's K/V shared by every sequence (segment_attention.py)
        entries += export_segment_graphs(config, shapes, work=work, writer=writer, cpu=cpu, plans=plans,
                                         on_step=step)
        (work / TOKENIZER_FILE).write_text(model.tokenizer_json)
        manifest = Manifest(
            model=config, graphs=tuple(entries), weights_file=WEIGHTS_FILE, weights_bytes=weights_bytes,
            weights_sha256=weights_sha, tokenizer_file=TOKENIZER_FILE, chat_template=model.chat_template,
            special_tokens=special_tokens(model), generation_defaults=model.generation_defaults, source=model.source,
            kv_layout=cpu.attention.kv_layout, kv_dtype=cpu.kv_dtype, dynamic_past=True,
            custom_ops=custom_ops(plans, cpu),
            exact_attention=cpu.staticlm_attention and cpu.attention is CpuAttention.GQA,
            rows_alone=rows_alone(plans, cpu),
            extra={"target": TARGET, "weights": cpu.to_dict(),
                   **({"source_grids": model.grid_summary()} if model.grid_summary() else {}),
                   **({"weight_rounding": rounding} if rounding else {})})
        manifest.save(work)
        step("manifest")
    return manifest


def _last_logits_only(*, cpu: CpuOptions, kind: GraphKind, shape: GraphShape, prefill_len: int) -> bool:
    """The in-place prompt-chunk graph scores its last row only; verify graphs (shorter ARs) score every row."""
    return cpu.attention is CpuAttention.GQA and kind is GraphKind.PREFILL and shape.ar == prefill_len


def num_cpu_steps(options: ExportOptions, config, *, cpu: CpuOptions, calibrated: bool = False) -> int:
    """One step per layer's weights, the rest of the weights, each graph file and the manifest (calibrated: the
    calibration family, its traces, its sampled answers and one GPTQ step per layer before them)."""
    extra = config.num_layers + 3 if calibrated else 0
    files = {graph_file(kind, shape, cpu=cpu) for _n, kind, shape in options.shapes()}
    return (config.num_layers + extra + len(files) + 2
            + (len(segment_shapes(options.shapes())) if segments_supported(config) else 0))
