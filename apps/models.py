"""How a front end opens a model: the one the options name, or the embedded default, exported on first use."""
from __future__ import annotations

import sys
from pathlib import Path

from staticlm.apps.commands.export import run_export
from staticlm.apps.home import DEFAULT_MODEL, default_model_dir
from staticlm.runtime.family.manifest import MANIFEST_NAME
from staticlm.runtime.model import Model, check_draft_model
from staticlm.runtime.options import RunOptions


def ensure_default_model(*, quiet: bool = False) -> Path:
    """Export the embedded default model once, the first time anything needs it."""
    target = default_model_dir()
    if (target / MANIFEST_NAME).is_file():
        return target
    if not quiet:
        print(f"First run: exporting the default model ({DEFAULT_MODEL}) to {target}", file=sys.stderr)
    run_export(model=DEFAULT_MODEL, out_dir=target, contexts=None, prefill_len=None, quiet=quiet)
    return target


def open_model(options: RunOptions) -> Model:
    """The model the options name, or the default one (exported first if need be). Every option has been
    checked by now (RunOptions checks its fields when made), and a missing draft model is refused before the
    possibly minutes-long first-run export."""
    check_draft_model(options.speculate_options())
    return Model.open(options.model_dir or ensure_default_model(), options)
