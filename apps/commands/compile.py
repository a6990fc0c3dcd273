"""`staticlm compile`: an HTP family into QNN context binaries ahead of time, so no load on the device (or the
emulator) pays for graph finalization."""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.errors import InvalidOption, UserError
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.family.weights import external_bytes
from staticlm.runtime.session.device import (
    DeviceOptions,
    compile_graph_contexts,
    compile_shared_context,
    context_groups,
    family_graph_files,
    max_context_weight_bytes,
)
from staticlm.runtime.session.qnn_context import EMULATOR, SHARED_PREFIX


def _binaries_mb(directory: Path, *, per_graph: bool) -> float:
    """The context binaries in the family's cache: per graph at its top, shared ones in their directories."""
    if per_graph:
        return sum(p.stat().st_size for p in directory.glob("*.bin")) / 1e6
    return sum(p.stat().st_size for p in directory.glob(f"{SHARED_PREFIX}*/*.bin")) / 1e6


def run_compile(*, model: Path, soc_model: str | None, per_graph: bool, quiet: bool = False) -> Path:
    manifest = load_manifest(model)  # a missing, corrupt or foreign-version family fails here, in one line
    if manifest.quant is None:
        raise InvalidOption(f"{model} is not an HTP family (its graphs are float or CPU-only): "
                        "export it with --target htp first")
    options = DeviceOptions(**({"soc_model": soc_model} if soc_model else {}))
    files = family_graph_files(model)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet) as progress:
        num_groups = len(context_groups(model))
        what = ("per-graph contexts" if per_graph else "one shared context" if num_groups == 1
                else f"{num_groups} shared contexts (the layer groups' parts)")
        task = progress.add_task(f"compiling {what} (SoC {options.soc_model})", total=len(files))

        def done(f: Path) -> None:
            progress.update(task, advance=1, description=f"compiled {f.stem}")

        compile_ = compile_graph_contexts if per_graph else compile_shared_context
        out = compile_(model, options=options, on_graph=done)
    if not quiet:
        print(f"compiled {len(files)} graphs of {model} into {out} ({_binaries_mb(out, per_graph=per_graph):.1f} MB "
              f"of context binaries) in {time.perf_counter() - t0:.1f} s")
        for line in context_report(model, soc_model=options.soc_model):
            print(line)
        if not per_graph and EMULATOR:
            print("note: the x86_64 emulator cannot load a multi-graph context; it is for the device. "
                  "Use --per-graph for contexts the emulator loads.")
    return out


def context_report(model: Path, *, soc_model: str) -> list[str]:
    """One line per shared context (context_groups): its graphs and the weight bytes they hold, against the SoC's
    limit (what --per-graph contexts also hold, one graph at a time)."""
    try:
        limit = max_context_weight_bytes(soc_model)
    except UserError:  # a SoC with no known limit: the bytes alone
        limit = None
    lines = []
    for k, files in enumerate(context_groups(model)):
        size = sum(external_bytes(files).values())
        over = "" if limit is None else f" of {limit} ({'OVER' if size > limit else 'within'})"
        lines.append(f"context {k}: {len(files)} graphs ({files[0].name} ...), {size} bytes of weights{over}")
    return lines
