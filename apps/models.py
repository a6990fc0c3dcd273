"""How a front end opens a model: the family the options name, or the embedded default model exported for this
machine on first use (`--target cpu` on a CPU-only host, `--target htp` where the QNN EP reports an NPU)."""
from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from staticlm.apps.home import DEFAULT_MODEL, TARGETS, default_model_dir
from staticlm.errors import InvalidOption
from staticlm.runtime.family.manifest import MANIFEST_NAME, ManifestError, load_manifest, read_manifest
from staticlm.runtime.model import Model, check_draft_model
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import npu_available


def default_target() -> str:
    """The export that runs fastest here: the NPU's quantized family, else the CPU's int4 one (the float family
    is the accuracy reference, `--model float`)."""
    return "htp" if npu_available() else "cpu"


def ensure_default_model(target: str | None = None, *, quiet: bool = False,
                         on_progress: Callable[[str, int, int], None] | None = None) -> Path:
    """The default model's family for target (default: this machine's), exported the first time it is needed."""
    target = target or default_target()
    out = default_model_dir(target)
    if (out / MANIFEST_NAME).is_file():
        try:
            load_manifest(out)
            return out
        except ManifestError as e:  # staticlm's own copy, made by an older version (or broken): made again
            if not quiet:
                print(f"The default model's family at {out} cannot be used ({e}): exporting it again",
                      file=sys.stderr)
            shutil.rmtree(out)
    elif not quiet:
        print(f"First run: exporting the default model ({DEFAULT_MODEL}, --target {target}) to {out}",
              file=sys.stderr)
    from staticlm.apps.exporting import run_export  # the exporter loads only when something is exported

    # its Q4_1 minima folded on the CPU (export --grid-minima): within a few hundredths of a level step of exact, and
    # two nodes fewer per linear for every decode step of the model most runs use
    run_export(model=DEFAULT_MODEL, out_dir=out, target=target, quiet=quiet, on_progress=on_progress,
               grid_minima="folded" if target == "cpu" else None)
    return out


def resolve_model_dir(model_dir: Path | None, **export_options) -> Path:
    """model_dir, or the default model's family: this machine's without one, the named target's for a bare
    `float`, `cpu` or `htp` that is not a directory here."""
    if model_dir is None:
        return ensure_default_model(**export_options)
    if str(model_dir) in TARGETS and not model_dir.exists():
        return ensure_default_model(str(model_dir), **export_options)
    return model_dir


def open_model(options: RunOptions, *, num_responses: int = 1) -> Model:
    """The model the options name (see resolve_model_dir). Every option has been checked by now (RunOptions
    checks its fields when made); a missing draft model is refused before the possibly minutes-long first-run
    export, and a family that cannot give num_responses before it loads."""
    check_draft_model(options.speculate_options())
    model_dir = resolve_model_dir(options.model_dir)
    if num_responses > 1 and not any(b > 1 for b in read_manifest(model_dir).batch_sizes):
        raise InvalidOption(f"{model_dir} has no batched graphs for several responses: export it with --batch-sizes")
    return Model.open(model_dir, options)
