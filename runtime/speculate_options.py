"""`--speculate none|lookup|draft:DIR`: one parsed choice, and the speculator it builds."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


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
            path = Path(text[len("draft:"):])
            if not str(path):
                raise ValueError("--speculate draft: needs a model directory, e.g. draft:path/to/draft")
            return cls(SpeculateMode.DRAFT, path, fixed_length)
        try:
            mode = SpeculateMode(text)
        except ValueError:
            raise ValueError(f"unknown --speculate {text!r}: choose none, lookup or draft:DIR") from None
        if mode is SpeculateMode.DRAFT:
            raise ValueError("--speculate draft needs a directory: draft:DIR")
        return cls(mode, None, fixed_length)


def build_speculator(options: SpeculateOptions, *, engine, tokenizer, engine_options=None):
    """The Speculator for these options (None for none); a draft model must share the tokenizer."""
    from .drafters import DraftModelDrafter, PromptLookupDrafter
    from .speculative import DraftLength, Speculator

    if options.mode is SpeculateMode.NONE:
        return None
    length = DraftLength(initial=options.fixed_length, fixed=True) if options.fixed_length else DraftLength()
    if options.mode is SpeculateMode.LOOKUP:
        return Speculator(PromptLookupDrafter(), length=length)
    from .engine import Engine, EngineOptions

    draft = Engine(options.draft_dir, options=engine_options or EngineOptions())
    if draft.manifest.model.vocab_size != engine.manifest.model.vocab_size or \
            _tokenizer_bytes(draft) != _tokenizer_bytes(engine):
        raise ValueError(f"the draft model {options.draft_dir} does not share the target's tokenizer")
    return Speculator(DraftModelDrafter(draft, tokenizer), length=length)


def _tokenizer_bytes(engine) -> bytes:
    return (engine.model_dir / engine.manifest.tokenizer_file).read_bytes()
