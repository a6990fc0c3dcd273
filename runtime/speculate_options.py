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


def build_speculator(options: SpeculateOptions, *, engine, tokenizer, engine_options=None, num_sequences: int = 1):
    """The Speculator for these options (None for none); a draft model must share the tokenizer.

    num_sequences > 1: a BatchSpeculator with one drafter per sequence (each draft model on its own
    KV buffers, all sharing one weight mapping).
    """
    from .batch_speculative import BatchSpeculator
    from .drafters import DraftModelDrafter, PromptLookupDrafter
    from .speculative import DraftLength, Speculator

    if options.mode is SpeculateMode.NONE:
        return None
    length = DraftLength(initial=options.fixed_length, fixed=True) if options.fixed_length else DraftLength()
    if options.mode is SpeculateMode.LOOKUP:
        drafters = [PromptLookupDrafter()] * num_sequences  # stateless: one serves every sequence
    else:
        from .engine import Engine, EngineOptions

        first = Engine(options.draft_dir, options=engine_options or EngineOptions())
        if first.manifest.model.vocab_size != engine.manifest.model.vocab_size or \
                _tokenizer_bytes(first) != _tokenizer_bytes(engine):
            raise ValueError(f"the draft model {options.draft_dir} does not share the target's tokenizer")
        engines = [first] + [Engine(options.draft_dir, options=first.options, weights_from=first)
                             for _ in range(num_sequences - 1)]
        drafters = [DraftModelDrafter(e, tokenizer) for e in engines]
    if num_sequences > 1:
        return BatchSpeculator(drafters, length=length)
    return Speculator(drafters[0], length=length)


def _tokenizer_bytes(engine) -> bytes:
    return (engine.model_dir / engine.manifest.tokenizer_file).read_bytes()
