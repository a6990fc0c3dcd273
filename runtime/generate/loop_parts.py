"""What the generation loop is handed (instead of the whole Model): its collaborators, named.

runtime/model.py's Model makes one (`Model.loop_parts`); a test or a bench may make its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from staticlm.runtime.generate.generator import Generator


@dataclass(frozen=True)
class LoopParts:
    """lane: the model's one-sequence engine and its Generator (whose tokens mirror its KV; lane.engine, its
    tokenizer); speculator(
    num_sequences=, engine=): the batch rows' speculator, or None (Model.speculator); speculates: --speculate asks
    for drafts; shared_prompt_kv: --shared-prompt-kv (rows that read one prompt segment, where the family has
    them)."""

    lane: Generator
    speculator: Callable[..., object]
    speculates: bool = False
    shared_prompt_kv: bool = False
