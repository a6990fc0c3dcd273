"""What a declared export option is (export/options.py): its flag, help and limits, and how a value from the command
line (text) or from Python becomes the field's value, or one InvalidOption line."""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staticlm.errors import InvalidOption


@dataclass(frozen=True)
class OptionSpec:
    help: str
    flag: str | None = None  # default: --field-name
    choices: tuple[str, ...] = ()  # the words a value may be (any case; a number's as text)
    low: int | None = None  # inclusive lower bound of a whole number
    # (value, flag) -> the field's value, for one that is neither a word nor a number (a list, a byte count)
    parse: Callable[[Any, str], Any] | None = None
    metavar: str | None = None


def option(default: Any, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"option": OptionSpec(help=help, **spec)})


def spec(f: dataclasses.Field) -> OptionSpec:
    return f.metadata["option"]


def flag(f: dataclasses.Field) -> str:
    return spec(f).flag or "--" + f.name.replace("_", "-")


def _hint(f: dataclasses.Field, owner: type) -> Any:
    return typing.get_type_hints(owner)[f.name]


def value_type(f: dataclasses.Field, owner: type) -> type:
    """The type of a field without a parser, Optional taken off: int, str, bool or Path."""
    args = [a for a in typing.get_args(_hint(f, owner)) if a is not type(None)]
    return args[0] if args else _hint(f, owner)


def is_optional(f: dataclasses.Field, owner: type) -> bool:
    return type(None) in typing.get_args(_hint(f, owner))


def coerce(f: dataclasses.Field, value: Any, *, owner: type) -> Any:
    s, name = spec(f), flag(f)
    if value is None:
        if not is_optional(f, owner):
            raise InvalidOption(f"{name} needs a value")
        return None
    if s.parse is not None:
        return s.parse(value, name)
    kind = value_type(f, owner)
    if kind is bool:
        if not isinstance(value, bool):
            raise InvalidOption(f"{name} is on or off, got {value!r}")
        return value
    if kind is int:
        value = whole_number(value, name)
        if s.low is not None and value < s.low:
            raise InvalidOption(f"{name} must be at least {s.low}, got {value}")
    elif kind is Path:
        if not isinstance(value, (str, Path)):
            raise InvalidOption(f"{name} takes a path, got {value!r}")
        value = Path(value).expanduser()
    else:
        value = str(value) if isinstance(value, Path) else value  # a source may be given as a path
        if not isinstance(value, str):
            raise InvalidOption(f"{name} takes text, got {value!r}")
        value = value.strip().lower() if s.choices else value
    if s.choices and str(value) not in s.choices:
        raise InvalidOption(f"{name} takes {either(s.choices)}, got {value!r}")
    return value


def either(words: tuple[str, ...]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def whole_number(value: Any, name: str) -> int:
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise InvalidOption(f"{name} takes a whole number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):
        raise InvalidOption(f"{name} takes a whole number, got {value!r}")
    return int(value)


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


def parse_bits_budget(value: Any, name: str) -> float | str:
    """Bits per weight, or 'none' (every projection at the low width)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return "none"
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise InvalidOption(f"{name} takes bits per weight (e.g. 4.5) or none, got {value!r}") from None


def parse_parts(value: Any, name: str) -> int | str:
    """A number of layer groups, or 'auto'."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return whole_number(value, name)
    except InvalidOption:
        raise InvalidOption(f"{name} takes a number of layer groups or auto, got {value!r}") from None


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
