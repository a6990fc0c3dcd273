"""One way to declare an option, for export and run alike: a dataclass field made by `option(default, help, ...)`.

`runtime/options.py`'s RunOptions and `export/options.py`'s ExportRequest are tables of such fields. From a field
come its flag and `--help` line (apps/option_flags.py builds every command's flags), the Python API's keyword of
the same name, the README's flag lists (tests/test_option_docs.py holds them to the tables), and the one check of a
value, `coerce`: a value typed on the command line (text), read from a settings file or passed from Python becomes
the field's type, or one InvalidOption line naming the flag.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from staticlm.errors import InvalidOption

SAME = object()  # an app_default equal to the command line's


@dataclass(frozen=True)
class OptionSpec:
    """What a front end needs to offer one option: its flag, help and limits."""

    help: str
    flag: str | None = None  # default: --field-name
    choices: tuple[str, ...] = ()  # the words a text value may be (any case; a number's as text)
    low: float | None = None  # inclusive lower bound (exclusive with low_exclusive)
    low_exclusive: bool = False
    high: float | None = None  # inclusive upper bound
    # (value, flag) -> the field's value, for one that is neither a word nor a number (a list, a byte count)
    parse: Callable[[Any, str], Any] | None = None
    metavar: str | None = None  # the value's name in --help and the README (default: from its type)
    reloads: bool = False  # a run option the engine is built from: changing it reopens the model
    app_default: Any = SAME  # a run option's default in the desktop app, where it differs


def option(default: Any, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"option": OptionSpec(help=help, **spec)})


def spec(f: dataclasses.Field) -> OptionSpec:
    return f.metadata["option"]


def flag(f: dataclasses.Field) -> str:
    return spec(f).flag or "--" + f.name.replace("_", "-")


def _hint(f: dataclasses.Field, owner: type) -> Any:
    return typing.get_type_hints(owner)[f.name]


def value_type(f: dataclasses.Field, owner: type) -> type:
    """The field's type without Optional: int, float, str, bool, Path, an Enum, or tuple."""
    hint = _hint(f, owner)
    if typing.get_origin(hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def is_optional(f: dataclasses.Field, owner: type) -> bool:
    return type(None) in typing.get_args(_hint(f, owner))


def metavar(f: dataclasses.Field, owner: type) -> str | None:
    """How a value is shown (None: a switch, which takes none)."""
    s, kind = spec(f), (None if spec(f).parse else value_type(f, owner))
    if kind is bool:
        return None
    if s.metavar:
        return s.metavar
    if s.choices:
        return "{" + ",".join(s.choices) + "}"
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "{" + ",".join(str(e.value) for e in kind) + "}"
    return {int: "N", float: "X", Path: "DIR"}.get(kind, "TEXT")


def coerce(f: dataclasses.Field, value: Any, *, owner: type) -> Any:
    """value as the field's type, checked against its choices and bounds; else one InvalidOption line."""
    s, name, kind = spec(f), flag(f), value_type(f, owner)
    if value is None or (value == "" and kind is Path):
        if not is_optional(f, owner):
            raise InvalidOption(f"{name} needs a value")
        return None
    if s.parse is not None:
        return s.parse(value, name)
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value.strip().lower() if isinstance(value, str) else value)
        except ValueError:
            raise InvalidOption(f"unknown {f.name.replace('_', ' ')} {value!r} ({name}): choose one of "
                                f"{', '.join(str(k.value) for k in kind)}") from None
    value = _typed(kind, value, name, choices=bool(s.choices))
    if s.choices and str(value) not in s.choices:
        raise InvalidOption(f"{name} takes {either(s.choices)}, got {value!r}")
    check_range(f, value)
    return value


def _typed(kind: type, value: Any, name: str, *, choices: bool) -> Any:
    if kind is tuple:
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise InvalidOption(f"{name} takes a list of strings, got {value!r}")
        return tuple(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise InvalidOption(f"{name} is on or off, got {value!r}")
        return value
    if kind is int:
        return whole_number(value, name)
    if kind is float:
        return number(value, name)
    if kind is Path:
        if not isinstance(value, (str, Path)):
            raise InvalidOption(f"{name} takes a path, got {value!r}")
        return Path(value).expanduser()
    value = str(value) if isinstance(value, Path) else value  # a source may be given as a path
    if not isinstance(value, str):
        raise InvalidOption(f"{name} takes text, got {value!r}")
    return value.strip().lower() if choices else value


def check_range(f: dataclasses.Field, value: Any) -> None:
    s = spec(f)
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise InvalidOption(f"{flag(f)} must be a number, got nan")
    low_ok = s.low is None or (value > s.low if s.low_exclusive else value >= s.low)
    high_ok = s.high is None or value <= s.high
    if not (low_ok and high_ok):
        low = "" if s.low is None else ("(" if s.low_exclusive else "[") + f"{s.low:g}"
        high = "" if s.high is None else f"{s.high:g}]"
        bound = f"in {low}, {high}" if s.low is not None and s.high is not None else \
            (f"> {s.low:g}" if s.low_exclusive else f">= {s.low:g}") if s.high is None else f"<= {s.high:g}"
        raise InvalidOption(f"{flag(f)} must be {bound}, got {value}")


def coerce_fields(instance: Any) -> None:
    """Every field of a frozen options dataclass, coerced in place (its __post_init__ calls this)."""
    for f in dataclasses.fields(instance):
        object.__setattr__(instance, f.name, coerce(f, getattr(instance, f.name), owner=type(instance)))


def either(words: tuple[str, ...]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def whole_number(value: Any, name: str) -> int:
    return _number(value, name, int)


def number(value: Any, name: str) -> float:
    return _number(value, name, float)


def _number(value: Any, name: str, kind: type) -> int | float:
    """value (a number, or its text) as kind; a float with a fraction is no whole number."""
    what = "a whole number" if kind is int else "a number"
    try:
        if isinstance(value, str):
            return kind(value.strip())
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
    except ValueError:
        raise InvalidOption(f"{name} takes {what}, got {value!r}") from None
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise InvalidOption(f"{name} takes {what}, got {value!r}")
    return kind(value)


def int_list(value: Any, name: str) -> tuple[int, ...]:
    """'256,512' or a sequence of whole numbers -> sorted, each once."""
    if isinstance(value, str):
        items: Any = [x for x in value.split(",") if x.strip()]
    elif isinstance(value, (tuple, list)) and not any(isinstance(x, (bool, str)) for x in value):
        items = value
    else:
        raise InvalidOption(f"{name} takes comma-separated integers, got {value!r}")
    try:
        return tuple(sorted({whole_number(x, name) for x in items}))
    except InvalidOption:
        raise InvalidOption(f"{name} takes comma-separated integers, got {value!r}") from None


def parse_bytes(value: Any, name: str = "--max-context-bytes") -> int:
    """2000000000, 1900M, 2G (powers of 1024), or a whole number."""
    if not isinstance(value, str):
        return whole_number(value, name)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = value.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise InvalidOption(f"{name} takes a byte count (2000000000, 1900M, 2G), got {value!r}") from None


def flag_list(owner: type) -> list[str]:
    """Every option of the table as the README lists it: `--flag VALUE` (a switch: `--flag`), in declared order."""
    out = []
    for f in dataclasses.fields(owner):
        shown = metavar(f, owner)
        out.append(flag(f) if shown is None else f"{flag(f)} {shown}")
    return out
