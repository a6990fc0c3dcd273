"""Structured output through llguidance: a JSON schema, a Lark grammar or a tool call's shape becomes a token
mask per step (the server's response_format and tools, `generate --json-schema/--grammar`).

llguidance builds the grammar's token masks from the family's own tokenizer.json (no transformers, no torch)
and fills them into numpy bitmasks; the generation loop masks the logits with them before sampling
(runtime/generate/sequence_request.py's Constraint).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from staticlm.errors import InvalidOption

# Compact JSON: a small model given free whitespace may spend its whole budget on it.
COMPACT = {"whitespace_flexible": False}


class GrammarError(InvalidOption):
    """A schema or grammar llguidance refuses (a 400)."""


class Grammars:
    """Compiles grammars for one tokenizer; the llguidance tokenizer is built on first use (about a second)."""

    def __init__(self, tokenizer_file: Path, *, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._file, self.vocab_size, self._eos = tokenizer_file, vocab_size, list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model) -> Grammars:
        """The grammars of an opened runtime.Model's family (its tokenizer.json, vocabulary and EOS tokens)."""
        m = model.manifest
        return cls(Path(model.engine.model_dir) / m.tokenizer_file, vocab_size=m.model.vocab_size,
                   eos_token_ids=model.tokenizer.eos_token_ids)

    def _llg(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._file.read_text(encoding="utf-8"),
                                                         n_vocab=self.vocab_size, eos_token=self._eos)
        return llguidance, self._tokenizer

    def json_schema(self, schema: dict[str, Any], *, param: str = "response_format") -> GrammarConstraints:
        llg, _ = self._llg()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        except ValueError as e:
            raise GrammarError(f"{param}: {e}") from None
        return self._check(grammar, param=param)

    def lark(self, grammar: str, *, param: str = "grammar") -> GrammarConstraints:
        """A grammar in llguidance's Lark syntax (`start: ...`; `%json {schema}` embeds a JSON schema)."""
        llg, _ = self._llg()
        try:
            compiled = llg.LLMatcher.grammar_from_lark(grammar)
        except ValueError as e:
            raise GrammarError(f"{param}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from None
        return self._check(compiled, param=param)

    def tool_call(self, tools: list[dict[str, Any]]) -> GrammarConstraints:
        """Exactly one Hermes-style call `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of one of the
        tools, its arguments valid against that tool's parameters."""
        options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                     "arguments": t.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": COMPACT}
        llg, _ = self._llg()
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
        return self._check(llg.LLMatcher.grammar_from_lark(lark), param="tools")

    def _check(self, grammar: str, *, param: str) -> GrammarConstraints:
        llg, tokenizer = self._llg()
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"{param}: {error.splitlines()[0]}")
        return GrammarConstraints(tokenizer, grammar)


class GrammarConstraints:
    """A factory of constraints for one grammar (the loop makes one per choice)."""

    def __init__(self, tokenizer, grammar: str) -> None:
        self._tokenizer, self._grammar = tokenizer, grammar

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self._tokenizer, self._grammar)


class GrammarConstraint:
    """runtime.sequence_request.Constraint over one llguidance matcher."""

    def __init__(self, tokenizer, grammar: str) -> None:
        import llguidance
        import llguidance.numpy as llnp

        self._llnp = llnp
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)  # [1, ceil(V / 32)] int32 bits

    def allowed(self, vocab_size: int) -> np.ndarray | None:
        if self._matcher.is_error():
            return np.zeros(vocab_size, bool)
        self._llnp.fill_next_token_bitmask(self._matcher, self._mask)
        bits = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little")  # [32 * ceil(V / 32)]
        out = np.zeros(vocab_size, bool)  # [V]
        n = min(vocab_size, bits.size)
        out[:n] = bits[:n]
        return out

    def consume(self, token_id: int) -> None:
        self._matcher.consume_token(int(token_id))


__all__ = ["GrammarConstraint", "GrammarConstraints", "GrammarError", "Grammars"]
