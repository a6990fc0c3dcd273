"""`staticlm export`'s flags: one per `export.options.ExportRequest` field (apps/option_flags.py), built without
loading the exporter (the parser of every command is built at each start)."""
from __future__ import annotations

import argparse

from staticlm.apps.option_flags import add_option_flags, typed_options
from staticlm.export.options import ExportRequest


def add_export_options(p: argparse.ArgumentParser) -> None:
    """One flag per ExportRequest field."""
    add_option_flags(p, ExportRequest)


def typed_export_options(args: argparse.Namespace) -> dict:
    """The export options the user typed, by field name."""
    return typed_options(args, ExportRequest)
