"""`staticlm export --target cpu [--weight-bits 4|8] [--cpu-attention gqa|windows]`: the MatMulNBits family."""
from __future__ import annotations

import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.export.cpu.family import export_cpu_family, num_cpu_steps
from staticlm.export.cpu.graph import CpuAttention, CpuOptions, WeightBits
from staticlm.export.family import ExportOptions
from staticlm.export.sources.load import load_model


def parse_cpu_options(*, target: str | None, weight_bits: int | None, attention: str | None = None) -> CpuOptions:
    if (target or "cpu").lower() != "cpu":
        raise ValueError(f"--weight-bits and --cpu-attention need --target cpu, got --target {target}")
    try:
        bits = WeightBits(weight_bits or 4)
    except ValueError:
        raise ValueError(f"--weight-bits takes 4 or 8, got {weight_bits}") from None
    try:
        kind = CpuAttention((attention or CpuAttention.GQA.value).lower())
    except ValueError:
        raise ValueError(f"--cpu-attention takes gqa or windows, got {attention!r}") from None
    return CpuOptions(bits=bits, attention=kind)


def run_export_cpu(*, model: str, out_dir: Path, options: ExportOptions, target: str | None,
                   weight_bits: int | None, attention: str | None = None, other_options: tuple = (), draft_layers: int | None = None,
                   quiet: bool = False) -> Path:
    if any(o is not None for o in other_options):
        raise ValueError("--quant, --kv-bits and --calib-steps belong to --target htp, not --target cpu")
    cpu = parse_cpu_options(target=target, weight_bits=weight_bits, attention=attention)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=quiet, transient=False) as progress:
        task = progress.add_task(f"reading {model}", total=num_cpu_steps(options) + 1)
        loaded = load_model(model)
        if draft_layers is not None:
            from staticlm.export.draft import truncate_layers

            loaded = truncate_layers(loaded, draft_layers)
        progress.update(task, advance=1, description=f"quantizing weights to {int(cpu.bits)} bits")
        manifest = export_cpu_family(loaded, out_dir, options=options, cpu=cpu,
                                     on_step=lambda name: progress.update(task, advance=1, description=f"wrote {name}"))
    if not quiet:
        files = sorted({g.file for g in manifest.graphs})
        print(f"exported {len(files)} int{int(cpu.bits)} (head int{int(cpu.head)}) CPU graphs, {cpu.attention.value} attention ({', '.join(files)}) serving "
              f"{len(manifest.graphs)} rungs to {out_dir} in {time.perf_counter() - t0:.1f} s")
    return Path(out_dir)
