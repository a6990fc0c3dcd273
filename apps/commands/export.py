"""`staticlm export`: a model source into a family, for the float reference, `--target cpu` or `--target htp`.

The flags are not written here: each is a field of `export.options.ExportRequest`, and `add_export_options` turns
every field into one. Only what the user typed reaches the namespace (argparse.SUPPRESS), so the defaults stay where
they are declared, and every value is checked (one line) when the request is made. The export itself is
`export.run.export_model`; this module shows its progress and its summary on stderr (stdout stays for results).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from staticlm.apps.commands.export_flags import add_export_options, typed_export_options
from staticlm.apps.home import DEFAULT_MODEL, default_model_dir
from staticlm.apps.interrupt import EXIT_INTERRUPTED
from staticlm.export.family import remove_own_staging
from staticlm.export.gptq.calibrated import format_table
from staticlm.export.options import ExportRequest
from staticlm.export.run import export_model

__all__ = ["add_export_options", "run_export", "run_export_command", "typed_export_options"]


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


def run_export_command(args: argparse.Namespace) -> int:
    request = ExportRequest(**typed_export_options(args))
    if request.out_dir is None:
        out = (default_model_dir(request.target) if request.model == DEFAULT_MODEL else
               Path(Path(request.model).stem + "-staticlm"))
        request = dataclasses.replace(request, out_dir=out)
    _interruptible(lambda: run_export(request), out_dir=request.out_dir)
    return 0


def _interruptible(work: Callable[[], Path], *, out_dir: Path) -> Path:
    """work() on a thread of its own while this one waits for it, so that Ctrl-C stops the export at once: inside a
    long native call (ORT's quantizer, a calibration session) Python would hold the interrupt until the call returns,
    for a minute or more on a large model. The output directory is as it was (the family is staged beside it), the
    scratch this process made is removed, and the process ends; the thread cannot be stopped otherwise."""
    result: list[Path] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:  # noqa: BLE001 -- raised again on the waiting thread
            failure.append(e)

    thread = threading.Thread(target=run, name="export", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except KeyboardInterrupt:
        remove_own_staging(out_dir)
        print(f"\nstaticlm: export interrupted; {out_dir} is as it was", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)
    if failure:
        raise failure[0]
    return result[0]
