"""`staticlm export --target htp`: the quantized family, with a progress bar over calibration and graphs."""
from __future__ import annotations

import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.export.family import ExportOptions
from staticlm.export.htp.calibration import calibration_prompts
from staticlm.export.htp.family import export_quantized_family, num_quant_steps
from staticlm.export.sources.load import load_model
from staticlm.runtime.family.quant_params import QuantOptions


def run_export_htp(*, model: str, out_dir: Path, options: ExportOptions, quant: QuantOptions,
                   draft_layers: int | None = None, quiet: bool = False) -> Path:
    t0 = time.perf_counter()
    prompts = calibration_prompts()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=quiet, transient=False) as progress:
        task = progress.add_task(f"reading {model}", total=num_quant_steps(options, len(prompts), quant.quant) + 1)
        loaded = load_model(model)
        if draft_layers is not None:
            from staticlm.export.draft import truncate_layers

            loaded = truncate_layers(loaded, draft_layers)
        progress.update(task, advance=1, description="float family")

        def step(name: str) -> None:
            progress.update(task, advance=1, description=f"{name}" if name.startswith("calib") else f"quantized {name}")

        manifest = export_quantized_family(loaded, out_dir, options=options, quant=quant, prompts=prompts,
                                           on_step=step)
    if not quiet:
        print(f"exported {len(manifest.graphs)} {quant.quant.value} graphs (KV {manifest.kv_dtype}) to {out_dir} "
              f"in {time.perf_counter() - t0:.1f} s")
    return Path(out_dir)
