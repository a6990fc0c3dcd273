"""`staticlm export`: a model source into a family, for the float reference, `--target cpu` or `--target htp`.

The flags are not written here: each is a field of `export.options.ExportRequest`, and `add_export_options` turns
every field into one. Only what the user typed reaches the namespace (argparse.SUPPRESS), so the defaults stay where
they are declared, and every value is checked (one line) when the request is made. The export itself is
`export.run.export_model`, its progress and summary shown by `apps/exporting.py` (on stderr: stdout stays for
results).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from staticlm.apps.commands.export_flags import add_export_options, typed_export_options
from staticlm.apps.exporting import run_export
from staticlm.apps.home import DEFAULT_MODEL, default_model_dir
from staticlm.apps.interrupt import EXIT_INTERRUPTED
from staticlm.export.family import remove_own_staging
from staticlm.export.options import ExportRequest

__all__ = ["add_export_options", "run_export", "run_export_command", "typed_export_options"]


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
