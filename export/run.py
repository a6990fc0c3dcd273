"""One export, whatever the target: read the source, optionally cut it to a draft model, write the family with the
target's writer, then its layer-group parts.

The steps are reported to report(what, advance=1, total=None) and lines meant for the user to note(line); the
caller shows them (apps/commands/export.py: a progress bar on stderr, or the desktop app's dialog).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from staticlm.errors import InvalidOption
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.manifest import Manifest

from .calibration.traces import calibration_prompts
from .cpu.family import export_cpu_family, num_cpu_steps
from .draft import truncate_layers
from .family import export_family, num_steps, staged_output
from .htp.family import export_quantized_family, num_quant_steps
from .htp.plan_report import plan_report
from .options import ExportRequest
from .parts import PartTooLarge, add_parts, layer_groups, sized_groups
from .sources import LoadedModel, load_model

Report = Callable[..., None]  # report(what, advance=1, total=None)


@dataclass(frozen=True)
class TargetWriter:
    num_steps: Callable[[ModelConfig], int]  # progress steps of the writer, once the source's config is known
    write: Callable[[LoadedModel, Path, Callable[[str], None]], Manifest]  # (source, out_dir, on_step)


def target_writer(request: ExportRequest) -> TargetWriter:
    options = request.family_options()
    if request.target == "cpu":
        cpu = request.cpu_options()
        return TargetWriter(
            lambda config: num_cpu_steps(options, config, cpu=cpu, calibrated=cpu.gptq is not None),
            lambda loaded, out, on_step: export_cpu_family(loaded, out, options=options, cpu=cpu, on_step=on_step))
    if request.target == "htp":
        quant, prompts = request.quant_options(), calibration_prompts()
        return TargetWriter(
            lambda config: num_quant_steps(request.graph_plan(config.max_positions).float_options(), len(prompts),
                                           quant.quant) + quant.num_gptq_steps(config),
            lambda loaded, out, on_step: export_quantized_family(
                loaded, out, plan=request.graph_plan(loaded.config.max_positions), quant=quant, prompts=prompts,
                on_step=on_step))
    return TargetWriter(lambda _config: num_steps(options),
                        lambda loaded, out, on_step: export_family(loaded, out, options=options, on_step=on_step))


def export_model(request: ExportRequest, *, report: Report | None = None,
                 note: Callable[[str], None] | None = None) -> Manifest:
    """The family request asks for, written to request.out_dir (atomically: see family.staged_family)."""
    if request.out_dir is None:
        raise InvalidOption("an export needs an output directory (--out)")
    report = report or (lambda *_args, **_kw: None)
    note = note or (lambda _line: None)
    writer = target_writer(request)
    num_parts, sizing = request.parts_plan()
    out = request.out_dir
    report(f"reading {request.model}", advance=0)
    loaded = load_model(request.model)
    report("read", total=1 + writer.num_steps(loaded.config))
    for line in (loaded.grid_summary() and f"keeping the GGUF's own weight grids: {loaded.grid_summary()}",
                 loaded.requantized_warning()):
        if line:
            note(line)
    if request.draft_layers is not None:
        loaded = truncate_layers(loaded, request.draft_layers)
    report("writing weights")
    if num_parts is not None:
        layer_groups(loaded.config.num_layers, num_parts)  # refused before the (possibly slow) export
    if num_parts is None and sizing is None:
        return writer.write(loaded, out, lambda name: report(f"wrote {name}"))
    # the family and its parts replace out together: an export stopped while its parts are cut leaves out as it was
    with staged_output(out) as family:
        manifest = writer.write(loaded, family, lambda name: report(f"wrote {name}"))
        if num_parts is not None:
            manifest = add_parts(family, num_parts)
        else:
            groups = sized_groups(family, sizing)
            if len(groups) > 1:  # one group: the whole graphs already fit one context
                manifest = add_parts(family, groups=groups)
        if request.target == "htp":  # a context over the SoC's limit is refused before the family is kept
            lines = plan_report(family, sizing=sizing or request.part_sizing(),
                                plan=request.graph_plan(loaded.config.max_positions))
            over = [line for line in lines if "(OVER)" in line]
            if over:
                raise PartTooLarge(f"{over[0].split(',')[0]} holds more weights than one context: export with "
                                   f"--parts auto, or more --parts")
    for line in lines if request.target == "htp" else ():
        note(line)
    return manifest
