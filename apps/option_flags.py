"""Every command's flags from the option tables (runtime/option_fields.py): one flag per field of RunOptions or
ExportRequest, its help line with the default, and its value passed on as typed, as text, so the table checks it
(one InvalidOption line). Only what the user typed reaches the namespace (argparse.SUPPRESS): the defaults stay
where they are declared."""
from __future__ import annotations

import argparse
import dataclasses
from enum import Enum
from typing import Any

from staticlm.runtime.option_fields import flag, metavar, spec, value_type


def add_option_flags(p: argparse.ArgumentParser | Any, owner: type) -> None:
    """One flag per field of the options dataclass owner, on p (a parser or an argument group)."""
    defaults = {f.name: f.default for f in dataclasses.fields(owner)}
    for f in dataclasses.fields(owner):
        default = defaults[f.name]
        shown = default.value if isinstance(default, Enum) else \
            ",".join(map(str, default)) if isinstance(default, tuple) else default
        kw: dict = {"dest": f.name, "default": argparse.SUPPRESS,
                    "help": spec(f).help + ("" if shown in (None, False, "") else f" (default: {shown})")}
        shown_value = metavar(f, owner)
        if shown_value is None:
            kw["action"] = "store_true"
        elif value_type(f, owner) is tuple and spec(f).parse is None:
            kw.update(action="append", metavar=shown_value)  # repeatable
        else:
            kw["metavar"] = shown_value
        p.add_argument(flag(f), **kw)


def typed_options(args: argparse.Namespace, owner: type) -> dict:
    """The options of owner the user typed, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(owner) if hasattr(args, f.name)}
