"""Token-level generation over an Engine, with onnxruntime-genai's ergonomics.

`tokens` mirrors exactly what the KV cache holds, so a caller can rewind to any
point (regenerate, edit a turn) and only ever prefill what is new.
"""
from __future__ import annotations

import numpy as np

from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.generate.sampling import SamplingParams, sample
from staticlm.runtime.text.tokenizer import Tokenizer

_GREEDY = SamplingParams()  # frozen, so one default object serves every call


class Generator:
    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.tokens: list[int] = []  # exactly the rows in the KV cache, in order
        self._pending: int | None = None  # sampled, returned, not yet run through the model
        self._logits: np.ndarray | None = None  # [V] next-token logits after `tokens`
        self._rng = np.random.default_rng()
        self.dropped: list[int] = []  # tokens the slide policy pushed out of the front of the cache
        self.speculator = None  # a speculative.Speculator, or None for one token per step

    # -- the genai-style primitives -------------------------------------------------------
    def append_tokens(self, ids) -> None:
        ids = [int(t) for t in ids]
        if self._pending is not None:
            ids.insert(0, self._pending)
            self._pending = None
        if not ids:
            raise ValueError("nothing to append: the prompt is empty")
        num_before = len(self.tokens)
        try:
            self._logits = self.engine.prefill(ids, previous=self.tokens[-1] if self.tokens else None).copy()
        except BaseException:
            # A failed or interrupted prefill must leave the cache exactly as the token list says.
            keep = min(num_before, self.engine.num_cached)
            if self.engine.can_truncate(keep):
                self.engine.truncate(keep)
            else:  # local layers slid past the rows a rewind needs: nothing cached is kept (sync_prefix resets)
                self.engine.reset()
            self._logits = None
            raise
        self.tokens.extend(ids)
        self._sync_slide()

    def generate_next_token(self, params: SamplingParams = _GREEDY) -> int:
        if self._pending is not None:
            self._logits = self.engine.decode(self._pending, previous=self.tokens[-1] if self.tokens else None).copy()
            self.tokens.append(self._pending)
            self._pending = None
            self._sync_slide()
        if self._logits is None:
            raise RuntimeError("append tokens before generating")
        token = sample(self._logits, params, rng=self._rng, history=self.tokens)
        self._pending = token
        return token

    def next_tokens(self, params: SamplingParams = _GREEDY) -> list[int]:
        """The next token, or several when a speculator is set and its drafts are accepted."""
        if self.speculator is not None:
            tokens = self.speculator.step(self, params)
            if tokens is not None:
                return tokens
        return [self.generate_next_token(params)]

    def feed(self, token: int) -> np.ndarray:
        """Run one chosen token through a decode step (beside the last cached one); its next-token logits [V]."""
        self._pending = None
        self._logits = self.engine.decode(token, previous=self.tokens[-1] if self.tokens else None).copy()
        self.tokens.append(token)
        self._sync_slide()
        return self._logits

    def speculate(self, pending: int, params: SamplingParams, *, rng: np.random.Generator) -> list[int] | None:
        """One draft-and-verify step after `pending` (chosen, not yet cached), drawing from rng: the tokens it
        gives (the accepted drafts, then the next one, which the caller feeds next), or None: not this step."""
        if self.speculator is None:
            return None
        self._pending, self._logits, saved = pending, None, self._rng
        self._rng = rng
        try:
            tokens = self.speculator.step(self, params)
        finally:
            self._rng, self._pending = saved, None
        return tokens

    def adopt(self, engine: Engine, *, row: int, token_ids: list[int]) -> None:
        """Start from the first len(token_ids) cached rows of engine's sequence `row` (their tokens): one copy."""
        self.reset()
        self.engine.load_row(0, engine, source_seq=row, num_rows=len(token_ids))
        self.tokens.extend(token_ids)

    def restore(self, token_ids: list[int], rows: np.ndarray) -> None:
        """Start from saved KV rows [T, n, D] of these n tokens (slots.py): one copy."""
        self.reset()
        self.engine.load_rows(0, rows)
        self.tokens.extend(token_ids)

    # -- what a speculator needs -------------------------------------------------------------
    @property
    def pending_token(self) -> int | None:
        return self._pending

    @property
    def next_logits(self) -> np.ndarray | None:
        """[V] logits after `tokens` (None while a sampled token is pending)."""
        return self._logits

    @property
    def rng(self) -> np.random.Generator:
        return self._rng

    def commit_speculated(self, last: int, accepted: list[int], nxt: int) -> None:
        """The engine committed `last` and the accepted drafts; `nxt` is sampled and pending."""
        self.tokens.append(last)
        self.tokens.extend(accepted)
        self._pending, self._logits = nxt, None
        self._sync_slide()

    def _sync_slide(self) -> None:
        """Under the slide policy the cache dropped its oldest rows; drop them from the list too."""
        num_dropped = len(self.tokens) - self.engine.num_cached
        if num_dropped > 0:
            self.dropped.extend(self.tokens[:num_dropped])
            del self.tokens[:num_dropped]

    def rewind_to(self, num_tokens: int) -> None:
        """Keep the first num_tokens cached tokens; anything after is forgotten without a copy."""
        num_tokens = max(0, min(num_tokens, len(self.tokens)))
        self.engine.truncate(num_tokens)
        del self.tokens[num_tokens:]
        self._pending, self._logits = None, None

    def reset(self) -> None:
        self.engine.reset()
        self.tokens.clear()
        self.dropped.clear()
        self._pending, self._logits = None, None

    def seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    # -- whole requests ---------------------------------------------------------------------
    def sync_prefix(self, ids: list[int]) -> list[int]:
        """Rewind to the longest cached prefix of `ids`; return what is left to prefill (never empty)."""
        if self.engine.num_cached != len(self.tokens):
            self.reset()  # the engine's cache was used or reset without this generator: nothing cached is known
        full_ids = ids
        if self.dropped:
            if ids[:len(self.dropped)] != self.dropped:
                self.reset()  # the conversation changed inside the part that slid out: start over
            else:
                ids = ids[len(self.dropped):]
        cached = self.tokens + ([self._pending] if self._pending is not None else [])
        common = 0
        for a, b in zip(cached, ids, strict=False):  # the shorter one ends the common prefix
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token must run to give fresh logits
        if common > len(self.tokens):  # the pending token starts the new part: append_tokens feeds it
            return ids[common:]
        if common < len(self.tokens):
            if not self.engine.can_truncate(common):  # local layers no longer hold the rows from there on
                self.reset()
                return full_ids
            self.rewind_to(common)
        self._pending = None
        return ids[common:]
