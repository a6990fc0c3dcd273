"""`staticlm export`'s flags: one per `export.options.ExportRequest` field, built without loading the exporter (the
parser of every command is built at each start)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from staticlm.export.option_fields import flag, spec, value_type
from staticlm.export.options import ExportRequest

METAVARS = {int: "N", str: "TEXT", Path: "DIR"}


def add_export_options(p: argparse.ArgumentParser) -> None:
    """One flag per ExportRequest field."""
    for f in dataclasses.fields(ExportRequest):
        s, default = spec(f), f.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        kw: dict = {"dest": f.name, "default": argparse.SUPPRESS,
                    "help": s.help + ("" if shown is None or shown is False else f" (default: {shown})")}
        kind = None if s.parse else value_type(f, ExportRequest)
        if kind is bool:
            kw["action"] = "store_true"
        else:  # text: ExportRequest reads it
            kw["metavar"] = s.metavar or ("{" + ",".join(s.choices) + "}" if s.choices else METAVARS[kind])
        p.add_argument(flag(f), **kw)


def typed_export_options(args: argparse.Namespace) -> dict:
    """The export options the user typed, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ExportRequest) if hasattr(args, f.name)}
