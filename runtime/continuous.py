"""Continuous batching: many requests share the batched decode graphs, each joining and leaving at step boundaries.

A request's prompt is prefilled on the model's one-sequence engine (through its Generator, which rewinds to
the longest prefix it already holds); its KV is then loaded into a free batch row once and the row decodes with
the others, one `decode_batch` call per step for all rows. A finished sequence's KV stays in its row for the
prompt cache (prompt_cache.py): a later prompt that starts with it (or with the prompt of a row still decoding,
a shared system prompt) copies that prefix to the prefill engine once and prefills only the rest. KV is copied
once per request (a row's prefix in, the prompt out into its row), never per token. The bookkeeping (which row is
whose, who waits) is scheduler.py's.

`step()` runs on one thread (the engine's); `submit()` may be called from any thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from staticlm.errors import InvalidOption
from staticlm.kv_manager import ContextFull

from .engine import Engine
from .family.manifest import GraphKind
from .generator import Generator
from .model import Model
from .prompt_cache import PromptCache, common_prefix
from .sampling import sample
from .scheduler import RowScheduler
from .sequence_request import (
    MAX_TOP_LOGPROBS,
    Admitted,
    Constraint,
    Delta,
    Failed,
    Finished,
    SequenceRequest,
    TokenLogprob,
    token_logprob,
)
from .text_stream import FinishReason, TextStream


@dataclass(eq=False)
class _Sequence:
    """One choice of a request, decoding in a batch row."""

    request: SequenceRequest
    choice: int
    stream: TextStream
    rng: np.random.Generator
    constraint: Constraint | None
    history: list[int]  # prompt + tokens so far (the repetition penalty's view)
    num_fed: int  # of the tokens chosen, how many the row's KV holds (all but the last, while it decodes)
    unsent_ids: list[int]  # tokens pushed since the last delta
    unsent_logprobs: list[TokenLogprob]
    solo: bool = False  # decoding alone on the prefill engine (its row holds nothing yet), see _decode_solo


def batch_size_for_serving(batch_sizes: tuple[int, ...]) -> int:
    """The rows to serve on: the largest exported batch (1: the family has no batched graphs)."""
    return max((b for b in batch_sizes if b > 1), default=1)


class ContinuousBatcher:
    """model: opened once; its generator prefills, a batched engine over the same weights decodes.

    max_queue: requests that may wait for rows beyond those the free rows take (past it, submit raises
    QueueFull); prompt_cache: reuse cached prefixes (off: every prompt is prefilled in full).
    """

    def __init__(self, model: Model, *, max_queue: int = 64, prompt_cache: bool = True) -> None:
        self.model, self.use_cache = model, prompt_cache
        self.generator: Generator = model.generator
        # rows of their own per request: the copy-based batched decode graphs (segmented ones share one prompt)
        num_rows = batch_size_for_serving(tuple(g.shape.batch for g in model.manifest.graphs
                                                if g.kind is GraphKind.DECODE))
        engine = model.engine
        self.batch = Engine(engine.model_dir, options=engine.options, batch=num_rows, weights_from=engine)
        self.batch.warm_up()
        self.scheduler: RowScheduler[_Sequence | SequenceRequest] = RowScheduler(num_rows=num_rows,
                                                                                 max_queue=max_queue)
        self.cache = PromptCache(num_rows)
        self._next = np.zeros(num_rows, np.int64)  # [B] the token each row feeds at the next step
        self.vocab_size = model.manifest.model.vocab_size
        self.num_steps = 0
        self.num_cancelled = 0  # choices that ended because their client went away

    @property
    def num_rows(self) -> int:
        return self.scheduler.num_rows

    @property
    def max_context(self) -> int:
        return self.batch.max_context

    # -- any thread ---------------------------------------------------------------------------------
    def submit(self, request: SequenceRequest) -> None:
        """Queue a request (QueueFull when the queue is full; a bad request raises a UserError here)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidOption("the prompt is empty")
        if n + request.params.max_new_tokens > self.max_context:
            raise ContextFull(f"{n} prompt tokens + {request.params.max_new_tokens} new tokens exceed the "
                              f"context of {self.max_context} tokens")
        if request.num_logprobs is not None and not 0 <= request.num_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidOption(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.num_logprobs}")
        self.scheduler.submit(request, num_rows=request.num_choices)

    # -- the engine's thread ------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits at this boundary, then one batched decode step; False when there was nothing to do."""
        self._reap_cancelled()
        worked = False
        admissible = self.scheduler.admissible()
        if admissible:
            self._migrate_solo()  # the prefill engine is needed: a lone sequence moves into its row
        for request, num_rows in admissible:
            worked = True
            if request.cancelled:
                self.scheduler.unreserve(num_rows)
                continue
            # Alone, a sequence decodes on the one-sequence graphs (cheaper than a batch of idle rows)
            solo = (len(admissible) == 1 and num_rows == 1 and not self.scheduler.busy_rows()
                    and not self.scheduler.num_waiting)
            try:
                self._admit(request, solo=solo)
            except Exception as e:  # noqa: BLE001 -- the request fails, the server keeps serving
                self.scheduler.unreserve(num_rows - self._fail(request, e))
                self.generator.reset()  # whatever the prefill left is unknown
        busy = self.scheduler.busy_rows()
        if busy:
            self._decode(busy)
            worked = True
        return worked

    def _admit(self, request: SequenceRequest, *, solo: bool = False) -> None:
        ids, gen = request.prompt_ids, self.generator
        free = self.scheduler.free_rows()
        row = None
        if not self.use_cache:
            gen.reset()
        else:
            row, num_in_row = self.cache.longest(ids, rows=free)
            source = row
            for r in self.scheduler.busy_rows():  # a row still decoding holds its prompt too (a shared system prompt)
                seq = self.scheduler.occupant(r)
                if seq.solo:
                    continue
                n = common_prefix(seq.request.prompt_ids + seq.stream.ids[:seq.num_fed], ids)
                if n > num_in_row:
                    source, num_in_row = r, n
            if source is not None and num_in_row > common_prefix(gen.tokens, ids):
                num = min(num_in_row, len(ids) - 1)  # at least one token runs, for fresh logits
                gen.reset()
                self.model.engine.load_row(0, self.batch, source_seq=source, num_rows=num)
                gen.tokens.extend(ids[:num])
        todo = gen.sync_prefix(list(ids))
        gen.append_tokens(todo)
        logits = gen.next_logits  # [V]
        num_cached = len(ids) - len(todo)
        self.cache.record(num_cached=num_cached)
        request.on_event(Admitted(num_prompt_tokens=len(ids), num_cached_tokens=num_cached,
                                  time=time.perf_counter()))
        seed = request.params.sampling.seed
        seqs = [_Sequence(request=request, choice=choice, stream=TextStream(self.model.tokenizer, request.params),
                          rng=np.random.default_rng(seed if seed is None or choice == 0 else (seed, choice)),
                          constraint=request.constraint() if request.constraint else None,
                          history=list(ids), num_fed=0, unsent_ids=[], unsent_logprobs=[])
                for choice in range(request.num_choices)]
        rows = self.cache.victims(request.num_choices, free=free, prefer=row)
        for r, seq in zip(rows, seqs, strict=True):
            self.cache.forget(r)
            seq.solo = solo
            if not solo:
                self.batch.load_row(r, self.model.engine)
            self.scheduler.occupy(r, seq)
        now = time.perf_counter()
        for r, seq in zip(rows, seqs, strict=True):
            self._choose(r, seq, logits=logits, now=now)

    def _migrate_solo(self) -> None:
        """A sequence decoding alone on the prefill engine moves into its batch row: one copy of its KV."""
        for r in self.scheduler.busy_rows():
            seq = self.scheduler.occupant(r)
            if seq.solo:
                self.batch.load_row(r, self.model.engine)
                seq.solo = False

    def _decode_solo(self, row: int, seq: _Sequence) -> None:
        """One step of the only sequence, on the one-sequence graphs; the generator's tokens mirror its KV."""
        try:
            self.generator.append_tokens([int(self._next[row])])
            self.num_steps += 1
            seq.num_fed += 1
            self._choose(row, seq, logits=self.generator.next_logits, now=time.perf_counter())
        except Exception as e:  # noqa: BLE001 -- fail this request, keep serving
            self.generator.reset()
            self._fail(seq.request, e)

    def _decode(self, busy: list[int]) -> None:
        if len(busy) == 1 and self.scheduler.occupant(busy[0]).solo:
            self._decode_solo(busy[0], self.scheduler.occupant(busy[0]))
            return
        self._migrate_solo()
        active = np.zeros(self.num_rows, bool)  # [B]
        active[busy] = True
        try:
            out = self.batch.decode_batch(self._next, active=active)  # [B, V]
        except Exception as e:  # noqa: BLE001 -- fail these requests, keep serving
            for request in {id(self.scheduler.occupant(r).request): self.scheduler.occupant(r).request
                            for r in busy}.values():
                self._fail(request, e)
            self.batch.reset()
            for r in range(self.num_rows):
                self.cache.forget(r)
            return
        self.num_steps += 1
        now = time.perf_counter()
        for r in busy:
            seq = self.scheduler.occupant(r)
            if seq is None:  # its request failed at an earlier row of this step
                continue
            seq.num_fed += 1
            try:
                self._choose(r, seq, logits=out[r], now=now)
            except Exception as e:  # noqa: BLE001 -- e.g. a grammar that broke: fail its request only
                self._fail(seq.request, e)

    def _choose(self, row: int, seq: _Sequence, *, logits: np.ndarray, now: float) -> None:
        """Sample the row's next token from logits [V], show what it lets through, end the sequence if it ended."""
        request = seq.request
        masked = logits
        if seq.constraint is not None:
            allowed = seq.constraint.allowed(logits.shape[-1])  # [V] bool
            if allowed is not None:
                if not allowed.any():  # the grammar cannot go on: end here
                    self._finish(row, seq, reason=FinishReason.STOP_STRING, now=now)
                    return
                masked = np.where(allowed, logits, -np.inf)
        token = sample(masked, request.params.sampling, rng=seq.rng, history=seq.history)
        if seq.constraint is not None:
            seq.constraint.consume(token)
        if request.num_logprobs is not None:
            seq.unsent_logprobs.append(token_logprob(logits, token, num_top=request.num_logprobs))
        seq.history.append(token)
        seq.unsent_ids.append(token)
        text = seq.stream.push(token, now=now)
        if seq.stream.reason is not None:
            self._finish(row, seq, reason=None, text=text, now=now)
            return
        self._next[row] = token
        if text:
            self._send(seq, text, now=now)

    def _send(self, seq: _Sequence, text: str, *, now: float) -> None:
        seq.request.on_event(Delta(choice=seq.choice, text=text, token_ids=tuple(seq.unsent_ids),
                                   logprobs=tuple(seq.unsent_logprobs), time=now))
        seq.unsent_ids.clear()
        seq.unsent_logprobs.clear()

    def _finish(self, row: int, seq: _Sequence, *, reason: FinishReason | None, now: float, text: str = "") -> None:
        """The sequence ended (reason None: as its stream says); its row is free, its KV kept for the cache."""
        if reason is not None:
            text += seq.stream.cancel()
        self.num_cancelled += reason is FinishReason.CANCELLED
        if text or seq.unsent_ids:
            self._send(seq, text, now=now)
        ids = seq.stream.ids
        if self.use_cache and not seq.solo:  # (a lone sequence's KV stays in the prefill engine's cache)
            self.cache.store(row, seq.request.prompt_ids + ids[:seq.num_fed])
        else:
            self.cache.forget(row)
        self.scheduler.release(row)
        seq.request.on_event(Finished(choice=seq.choice, reason=reason or seq.stream.reason, token_ids=tuple(ids),
                                      text=seq.stream.text, time=now))

    def _fail(self, request: SequenceRequest, error: BaseException) -> int:
        """The request ends with an error: its rows are freed (their KV forgotten); returns how many it held."""
        rows = [r for r in self.scheduler.busy_rows() if self.scheduler.occupant(r).request is request]
        for r in rows:
            self.scheduler.release(r)
            self.cache.forget(r)
        request.on_event(Failed(error))
        return len(rows)

    def _reap_cancelled(self) -> None:
        """Rows of requests whose client went away are free before the next step runs."""
        now = time.perf_counter()
        for r in self.scheduler.busy_rows():
            seq = self.scheduler.occupant(r)
            if seq.request.cancelled:
                self._finish(r, seq, reason=FinishReason.CANCELLED, now=now)
        for request in self.scheduler.waiting():
            if request.cancelled:
                self.scheduler.drop_waiting(request)

    # -- for /health and /metrics ----------------------------------------------------------------------
    def status(self) -> dict[str, int]:
        stats = self.cache.stats
        return {"rows": self.num_rows, "rows_in_use": self.scheduler.num_busy, "waiting": self.scheduler.num_waiting,
                "cached_rows": self.cache.num_cached_rows, "prompt_cache_lookups": stats.num_lookups,
                "prompt_cache_hits": stats.num_hits, "prompt_cache_tokens": stats.num_cached_tokens,
                "decode_steps": self.num_steps, "cancelled": self.num_cancelled,
                "kv_bytes": self.model.engine.kv.stats.reserved_bytes + self.batch.kv.stats.reserved_bytes}


__all__ = ["ContinuousBatcher", "batch_size_for_serving"]
