"""`--speculate none|lookup|draft:DIR`: one parsed choice (runtime/model.py builds its speculator)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from staticlm.errors import InvalidOption


class SpeculateMode(str, Enum):
    NONE = "none"
    LOOKUP = "lookup"
    DRAFT = "draft"


@dataclass(frozen=True)
class SpeculateOptions:
    mode: SpeculateMode = SpeculateMode.NONE
    draft_dir: Path | None = None
    fixed_length: int | None = None  # None: BASS's dynamic draft length

    @classmethod
    def parse(cls, text: str | None, *, fixed_length: int | None = None) -> SpeculateOptions:
        text = (text or "none").strip()
        if text.startswith("draft:"):
            directory = text[len("draft:"):].strip()
            if not directory:
                raise InvalidOption("--speculate draft: needs a model directory, e.g. draft:path/to/draft")
            return cls(SpeculateMode.DRAFT, Path(directory).expanduser(), fixed_length)
        try:
            mode = SpeculateMode(text)
        except ValueError:
            raise InvalidOption(f"unknown --speculate {text!r}: choose none, lookup or draft:DIR") from None
        if mode is SpeculateMode.DRAFT:
            raise InvalidOption("--speculate draft needs a directory: draft:DIR")
        return cls(mode, None, fixed_length)
