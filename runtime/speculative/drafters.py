"""Where draft tokens come from: the conversation itself (prompt lookup), or a smaller model."""
from __future__ import annotations

import numpy as np

from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.generate.generator import Generator
from staticlm.runtime.generate.sampling import SamplingParams, distribution
from staticlm.runtime.text.tokenizer import Tokenizer


class PromptLookupDrafter:
    """n-gram match against the context so far (no second model): copy what followed the last match.

    Input-grounded tasks (rewrite, summarise, edit code) repeat long spans of their input, so the
    continuation of the most recent earlier occurrence of the last n tokens is a cheap, good draft.
    """

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: list[int], num_tokens: int, *, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], None]:
        ids = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, ids.size - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram, no copy
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n  # the most recent match: closest to what is being written
                return ids[follow:follow + num_tokens].tolist(), None
        return [], None


class DraftModelDrafter:
    """A smaller model with the same tokenizer, on its own KV buffers, rolled back with truncate."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.generator = Generator(engine, tokenizer)

    def propose(self, context: list[int], num_tokens: int, *, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray]]:
        gen = self.generator
        # Rewinds to the longest prefix its cache shares with the context: rejected drafts go, nothing re-prefills.
        gen.append_tokens(gen.sync_prefix(list(context)))
        tokens: list[int] = []
        proposals: list[np.ndarray] = []
        for i in range(num_tokens):
            q = distribution(gen.next_logits, params, history=context + tokens)
            cdf = np.cumsum(q)
            token = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), q.size - 1))
            tokens.append(token)
            proposals.append(q)
            if i + 1 < num_tokens:
                if gen.engine.num_cached + 1 >= gen.engine.max_context:
                    break  # the draft's own context is full: propose what there is
                gen.append_tokens([token])
        return tokens, proposals
