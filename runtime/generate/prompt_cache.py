"""Which token sequences the batch rows still hold, for reuse by the next prompt (llama-server's cache_prompt).

A finished sequence's KV stays in its row. A chat client re-sends the whole conversation every turn, so the
next turn's prompt usually starts with a row's tokens (the last prompt and its answer); the loop then copies
that prefix to the prefill engine once and prefills only what follows. Each row keeps its own prefix: clients
that take turns with different system prompts each find theirs in a row. A new sequence overwrites a row it
mostly repeats (the same conversation a turn on), else an empty row, else the least recently used one. Pure
bookkeeping: token lists and a use clock per row; the KV itself never moves here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A new sequence overwrites a free row in place when its prompt starts with at least this share of the row's tokens:
# it then holds nearly all the row held (the same conversation a turn on, or the same prompt asked again), and a
# second row would keep a copy. Below it the row holds another prompt (another client's system prompt, which shares
# only the chat template's first tokens with this one), and stays for that client's next turn.
MIN_REPEATED_SHARE = 0.5

def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheStats:
    num_lookups: int = 0
    num_hits: int = 0  # lookups that reused at least one cached token
    num_cached_tokens: int = 0  # prompt tokens not prefilled, summed


class PromptCache:
    """Per row: the tokens its KV holds (valid once the row's sequence ended) and when it was last used."""

    def __init__(self, num_rows: int) -> None:
        self._tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self._used = [0] * num_rows  # a logical clock, larger = more recent
        self._clock = 0
        self.stats = CacheStats()

    def store(self, row: int, token_ids: Sequence[int]) -> None:
        """The row's KV holds exactly these tokens (its sequence ended)."""
        self._tokens[row] = list(token_ids)
        self._clock += 1
        self._used[row] = self._clock

    def forget(self, row: int) -> None:
        """The row is being overwritten (or was never filled)."""
        self._tokens[row] = []

    def touch(self, row: int) -> None:
        """The row's prefix served a prompt: it is the most recently used."""
        self._clock += 1
        self._used[row] = self._clock

    def tokens(self, row: int) -> list[int]:
        return self._tokens[row]

    def longest(self, ids: Sequence[int], *, rows: Sequence[int]) -> tuple[int | None, int]:
        """(the row among `rows` whose tokens share the longest prefix with ids, that length); (None, 0): none."""
        best, best_len = None, 0
        for row in rows:
            n = common_prefix(self._tokens[row], ids)
            if n > best_len:
                best, best_len = row, n
        return best, best_len

    def record(self, *, num_cached: int) -> None:
        """One prompt looked up; num_cached of its tokens were not prefilled."""
        self.stats.num_lookups += 1
        self.stats.num_hits += num_cached > 0
        self.stats.num_cached_tokens += num_cached

    def victims(self, num: int, *, free: Sequence[int], prompt: Sequence[int] = ()) -> list[int]:
        """num free rows to give a new request whose prompt is `prompt`: first the rows it repeats (at least
        MIN_REPEATED_SHARE of a row's tokens start the prompt; the most shared first), overwritten in place, then
        empty rows, then the least recently used cached ones (LRU eviction)."""
        if num > len(free):
            raise ValueError(f"{num} rows asked, {len(free)} free")

        def order(row: int) -> tuple[bool, int, bool, int]:
            tokens = self._tokens[row]
            shared = common_prefix(tokens, prompt)
            repeated = bool(tokens) and shared >= MIN_REPEATED_SHARE * len(tokens)
            return not repeated, -shared if repeated else 0, bool(tokens), self._used[row]
        return sorted(free, key=order)[:num]

    def cached_rows(self, rows: Sequence[int]) -> list[int]:
        """Those of `rows` that hold a cached prefix, least recently used first."""
        return sorted((r for r in rows if self._tokens[r]), key=lambda r: self._used[r])

    @property
    def num_cached_rows(self) -> int:
        return sum(bool(t) for t in self._tokens)


__all__ = ["MIN_REPEATED_SHARE", "CacheStats", "PromptCache", "common_prefix"]
