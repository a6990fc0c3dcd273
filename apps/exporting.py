"""One export with its progress shown: a bar on stderr, or a callback (the desktop app's dialog), then the summary.

`staticlm export` (commands/export.py), the first run's export of the default model (models.py) and the benches call
it; it sits beside them rather than in commands/, so opening the default model does not import the CLI's commands.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.export.gptq.calibrated import format_table
from staticlm.export.options import ExportRequest
from staticlm.export.run import export_model


def run_export(request: ExportRequest | None = None, *, on_progress: Callable[[str, int, int], None] | None = None,
               **options) -> Path:
    """request (or ExportRequest(**options)) written with a progress bar on stderr, or with on_progress(what, done,
    total) after each step instead (the desktop app's dialog); then the summary, unless quiet."""
    if request is not None and options:
        raise TypeError("run_export takes a request or its options, not both")
    request = request or ExportRequest(**options)
    t0 = time.perf_counter()
    with _progress(1, quiet=request.quiet, on_progress=on_progress) as report:
        manifest = export_model(request, report=report,
                                note=None if request.quiet else lambda line: print(line, file=sys.stderr))
    if not request.quiet:
        rounding = manifest.extra.get("weight_rounding")
        if rounding:
            print(format_table(rounding["error"], rounding["options"]["rounding"]), file=sys.stderr)
        files = sorted({g.file for g in manifest.graphs})
        print(f"exported {len(files)} {request.describe()} graphs serving {len(manifest.graphs)} shapes (KV "
              f"{manifest.kv_dtype}) to {request.out_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return Path(request.out_dir)


@contextmanager
def _progress(total: int, *, quiet: bool, on_progress: Callable[[str, int, int], None] | None
              ) -> Iterator[Callable[..., None]]:
    """report(what, advance=1, total=None): a progress bar on stderr (stdout stays for results), or on_progress;
    total, once the model is read, sets the number of steps."""
    if on_progress is not None:
        done = 0

        def report(what: str, advance: int = 1, total: int | None = None) -> None:
            nonlocal done
            done += advance
            size = total if total is not None else report.total
            report.total = size
            on_progress(what, done, size)

        report.total = total
        yield report
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True) as progress:
        task = progress.add_task("", total=total)
        yield lambda what, advance=1, total=None: progress.update(task, advance=advance, description=what,
                                                                  **({"total": total} if total else {}))
