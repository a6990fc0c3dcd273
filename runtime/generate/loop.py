"""The generation loop: every request, from `generate` to the server, is admitted, scheduled onto rows, stepped
and finished here, one `step()` at a time (schedule -> prefill a chunk -> decode every row).

Execution lives in the engines, bookkeeping apart: scheduler.py (which row holds whom, who waits),
prompt_cache.py (which tokens a row's KV holds), running.py (a choice's tokens, text and sampling); admission.py
takes a request from the queue to its rows (its prompt prefilled on the lane a chunk per step), this module steps
what is placed and finishes it.

- The **lane** is the model's one-sequence engine and its Generator (whose token list mirrors its KV). Prompts
  are prefilled there, one chunk per step while rows decode (a long prompt does not stall them). A sequence that
  runs alone decodes there too, with the single-sequence speculator.
- The **rows** (rows.py) decode the other sequences together, one call per step for all of them: copies of the
  prompt in batch rows (continuous batching, with the prompt cache), or one shared prompt segment read in place
  (a family whose batched graphs are segmented, or `--shared-prompt-kv`). Speculation runs on ragged rows.
- Greedy is a function of the tokens: a family whose ops compute every row alone (staticlm's attention and GGUF
  kernels, Manifest.rows_alone) gives a row the same bits on any path; elsewhere the engines never run a row alone
  (Engine.pairs_rows), and a greedy request runs on the lane where the rows would not give it the lane's bits
  (Rows.greedy_exact, admission.py).

`step()` runs on one thread (the engine's); `submit()` may be called from any thread.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from staticlm.errors import InvalidOption
from staticlm.kv_manager import ContextFull, Overflow
from staticlm.runtime.generate.admission import Admission, Admissions
from staticlm.runtime.generate.loop_parts import LoopParts
from staticlm.runtime.generate.prompt_cache import PromptCache, common_prefix
from staticlm.runtime.generate.rows import Rows
from staticlm.runtime.generate.running import RunningSequence, choose, push
from staticlm.runtime.generate.scheduler import RowScheduler
from staticlm.runtime.generate.sequence_request import (
    MAX_TOP_LOGPROBS,
    Delta,
    Failed,
    Finished,
    SequenceRequest,
)
from staticlm.runtime.generate.slots import Prefix
from staticlm.runtime.generate.text_stream import FinishReason


class GenerationLoop:
    """parts: the lane, the speculator factory and the options the loop reads (loop_parts.py; Model.loop_parts);
    max_queue: requests that may wait beyond the rows free now (QueueFull past it); prompt_cache: reuse the rows'
    cached prefixes; eager: open the rows' graphs now (a server), not when a second sequence first needs them; rows:
    force "copies" or "segments" (see rows.py)."""

    def __init__(self, parts: LoopParts, *, max_queue: int = 64, prompt_cache: bool = True, eager: bool = False,
                 rows: str | None = None) -> None:
        self.parts, self.use_cache = parts, prompt_cache
        self.lane = parts.lane
        self.rows = Rows(parts, eager=eager, kind=rows)
        self.scheduler: RowScheduler = RowScheduler(num_rows=self.rows.num_rows, max_queue=max_queue)
        self.cache = PromptCache(self.rows.num_rows)
        self.admissions = Admissions(lane=self.lane, rows=self.rows, scheduler=self.scheduler,
                                     cache=self.cache, use_cache=prompt_cache)
        self.num_steps = 0
        self.num_cancelled = 0  # choices that ended because their client went away

    @property
    def num_rows(self) -> int:
        return self.scheduler.num_rows

    @property
    def max_context(self) -> int:
        return self.lane.engine.max_context

    @property
    def max_prefill_tokens(self) -> int:
        """Prompt tokens a step prefills (rows decode between steps)."""
        return self.admissions.max_prefill_tokens

    # -- any thread ---------------------------------------------------------------------------------
    def submit(self, request: SequenceRequest) -> None:
        """Queue a request (QueueFull when the queue is full; a bad request raises a UserError here)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidOption("the prompt is empty")
        if n >= self.max_context and not self._slides(request):  # an answer that fills the context ends there
            raise ContextFull(f"context full: {n} prompt tokens leave no room for an answer in the context of "
                              f"{self.max_context} tokens; use a shorter prompt or --on-overflow slide")
        if request.num_logprobs is not None and not 0 <= request.num_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidOption(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.num_logprobs}")
        self.scheduler.submit(request, num_rows=request.num_choices)

    def _slides(self, request: SequenceRequest) -> bool:
        """One choice under the slide policy runs past the context on the lane (its oldest rows slide out)."""
        return self.lane.engine.options.overflow is Overflow.SLIDE and request.num_choices == 1

    # -- the engine's thread ------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, prefill one chunk, decode every row once; False when there was nothing to do."""
        self._reap_cancelled()
        admitted = self.admissions.schedule()
        prefilled, done = self.admissions.prefill_chunk()
        if done is not None:
            self._start_decoding(done)
        decoded = self._decode()
        return admitted or prefilled or decoded

    def _start_decoding(self, adm: Admission) -> None:
        """The prefilled request's choices take their rows and choose their first tokens from the lane's logits."""
        try:
            rows, seqs = self.admissions.place(adm)
        except Exception as e:  # noqa: BLE001 -- e.g. a seed the rng refuses: fail its request only
            self._fail(adm.request, e)
            self._settle_reservations()
            return
        logits, now = self.lane.next_logits, time.perf_counter()  # [V]
        for r, seq in zip(rows, seqs, strict=True):
            try:
                self._take(r, seq, choose(seq, logits), now=now)
            except Exception as e:  # noqa: BLE001 -- e.g. a grammar that broke: fail its request only
                self._fail(adm.request, e)
                return

    def _decode(self) -> bool:
        busy = self.scheduler.busy_rows()
        if not busy:
            return False
        solo = [r for r in busy if self.scheduler.occupant(r).solo]
        if solo and (len(busy) > 1 or self.admissions):
            self.admissions.migrate_solo()
            solo = []
        self.num_steps += 1
        if solo:
            self._decode_solo(solo[0], self.scheduler.occupant(solo[0]))
            return True
        seqs = {r: self.scheduler.occupant(r) for r in busy}
        try:
            tokens = self.rows.step(seqs)  # row -> new tokens (speculated) or logits [V] to choose from
        except Exception as e:  # noqa: BLE001 -- fail these requests, keep serving
            for request in {id(s.request): s.request for s in seqs.values()}.values():
                self._fail(request, e)
            self.rows.reset()
            for r in range(self.num_rows):
                self.cache.forget(r)
            return True
        now = time.perf_counter()
        for r, out in tokens.items():
            seq = seqs[r]
            if self.scheduler.occupant(r) is not seq:  # its request failed at an earlier row of this step
                continue
            try:
                self._feed(r, seq, out, now=now)
            except Exception as e:  # noqa: BLE001 -- e.g. a grammar that broke: fail its request only
                self._fail(seq.request, e)
        return True

    def _decode_solo(self, row: int, seq: RunningSequence) -> None:
        """One step of the only sequence on the lane: speculative when it may be, else one token."""
        try:
            spec = self.lane.speculate(seq.pending, seq.request.params.sampling, rng=seq.rng) if seq.plain else None
            out = spec if spec is not None else self.lane.feed(seq.pending)
            self._feed(row, seq, out, now=time.perf_counter())
        except Exception as e:  # noqa: BLE001 -- fail this request, keep serving
            self.lane.reset()
            self._fail(seq.request, e)

    def _feed(self, row: int, seq: RunningSequence, out, *, now: float) -> None:
        """The row ran its pending token: out is its logits [V] to choose from, or the speculated tokens."""
        if isinstance(out, list):
            seq.num_fed += len(out)  # the pending token and the accepted drafts are in the KV now
            for token in out:
                if not self._take(row, seq, token, now=now):
                    return
            return
        seq.num_fed += 1
        self._take(row, seq, choose(seq, out), now=now)

    def _take(self, row: int, seq: RunningSequence, token: int | None, *, now: float) -> bool:
        """Push a chosen token (None: the grammar ended the choice); False once the choice has ended."""
        if token is None:
            self._finish(row, seq, reason=FinishReason.STOP_STRING, now=now)
            return False
        text = push(seq, token, now=now)
        if seq.stream.reason is not None:
            self._finish(row, seq, reason=None, text=text, now=now)
            return False
        if len(seq.history) > self.max_context and not self._slides(seq.request):  # no row left to feed it into
            self._finish(row, seq, reason=FinishReason.LENGTH, text=text, now=now)
            return False
        if text:
            self._send(seq, text, now=now)
        return True

    def _send(self, seq: RunningSequence, text: str, *, now: float) -> None:
        token_ids, logprobs = tuple(seq.unsent_ids), tuple(seq.unsent_logprobs)
        for choice in seq.choices:
            seq.request.on_event(Delta(choice=choice, text=text, token_ids=token_ids, logprobs=logprobs, time=now))
        seq.unsent_ids.clear()
        seq.unsent_logprobs.clear()

    def _finish(self, row: int, seq: RunningSequence, *, reason: FinishReason | None, now: float,
                text: str = "") -> None:
        """The choice ended (reason None: as its stream says); its row is free, its KV kept for the cache."""
        if reason is not None:
            text += seq.stream.cancel()
        self.num_cancelled += reason is FinishReason.CANCELLED
        if text or seq.unsent_ids:
            self._send(seq, text, now=now)
        ids = seq.stream.ids
        cached = seq.request.prompt_ids + ids[:seq.num_fed]
        keeps = self.use_cache and self.rows.keeps_prefixes
        # A lone sequence's row gets one copy of its KV, where rows are open: the lane's lasts to the next prompt only
        copied = keeps and seq.solo and self.rows.opened and self.lane.tokens == cached
        if copied:
            self.rows.load([row], self.lane.engine)
        if keeps and (copied or not seq.solo):
            self.cache.store(row, cached)
        else:
            self.cache.forget(row)
        self.scheduler.release(row)
        for choice in seq.choices:
            seq.request.on_event(Finished(choice=choice, reason=reason or seq.stream.reason, token_ids=tuple(ids),
                                          text=seq.stream.text, time=now, first_time=seq.stream.first_s))

    def _fail(self, request: SequenceRequest, error: BaseException) -> int:
        """The request ends with an error: its rows are freed (their KV forgotten); returns how many it held."""
        rows = [r for r in self.scheduler.busy_rows() if self.scheduler.occupant(r).request is request]
        for r in rows:
            self.scheduler.release(r)
            self.cache.forget(r)
        request.on_event(Failed(error))
        return len(rows)

    def _settle_reservations(self) -> None:
        """Rows reserved for no admission waiting for the lane (one whose placing failed) are free again."""
        s = self.scheduler
        num_reserved = len(s.free_rows()) - s.num_free
        s.unreserve(num_reserved - sum(a.num_rows for a in self.admissions.pending))

    def fail_in_flight(self, error: BaseException) -> None:
        """A step raised where no request's own error path caught it: every request that holds rows or is being
        prefilled fails with that error, and the lane and rows start over (what their KV holds is unknown);
        waiting requests stay queued. The caller (a server's engine thread) goes on stepping."""
        failed = {id(a.request): a.request for a in self.admissions.pending}
        failed.update({id(s.request): s.request for r in self.scheduler.busy_rows()
                       if (s := self.scheduler.occupant(r)) is not None})
        self.admissions.pending.clear()
        for request in failed.values():
            self._fail(request, error)
        self._settle_reservations()
        self.rows.reset()
        self.lane.reset()
        for r in range(self.num_rows):
            self.cache.forget(r)

    def _reap_cancelled(self) -> None:
        """Rows of requests whose client went away are free before the next step runs."""
        now = time.perf_counter()
        for r in self.scheduler.busy_rows():
            seq = self.scheduler.occupant(r)
            if seq.request.cancelled:
                self._finish(r, seq, reason=FinishReason.CANCELLED, now=now)
        self.admissions.reap_cancelled(now=now)

    # -- the prompt cache across restarts (slots.py); on the engine's thread, or while it does not step ----------
    @property
    def max_saved_prefixes(self) -> int:
        """How many prefixes the cache holds: one per row that keeps its prompt, else the lane's one."""
        return self.num_rows if self.rows.keeps_prefixes else 1

    def cached_prefixes(self) -> list[Prefix]:
        """What the prompt cache holds, least recently used first: each free row's tokens, then the lane's (its
        KV read only when asked, before the next step)."""
        if not self.use_cache:
            return []
        out = []
        if self.rows.keeps_prefixes:
            for r in self.cache.cached_rows(self.scheduler.free_rows()):
                out.append(Prefix(list(self.cache.tokens(r)), partial(self.rows.engine.kv.valid_block, r)))
        lane, ids = self.lane, list(self.lane.tokens)
        synced = ids and not lane.dropped and lane.engine.num_cached == len(ids)
        if synced and not any(common_prefix(p.token_ids, ids) == len(ids) for p in out):
            out.append(Prefix(ids, self._lane_rows))
        return out[-self.max_saved_prefixes:]

    def _lane_rows(self) -> np.ndarray | None:
        """[T, n, D] the lane's cached rows; None when its local layers kept only their newest (layered.py)."""
        try:
            return self.lane.engine.kv.valid_block(0)
        except ValueError:
            return None

    def restore_prefixes(self, prefixes: list[tuple[list[int], np.ndarray]]) -> int:
        """Saved (token ids, KV rows [T, n, D]), least recently used first, into the free rows (or the lane when
        rows keep no prompt): later prompts with these prefixes skip their prefill. Returns how many it took."""
        if not self.use_cache or not prefixes:
            return 0
        if not self.rows.keeps_prefixes:
            ids, kv = prefixes[-1]
            self.lane.restore(ids, kv)
            return 1
        rows = self.scheduler.free_rows()
        taken = prefixes[-len(rows):]
        for r, (ids, kv) in zip(rows, taken, strict=False):
            self.rows.engine.load_rows(r, kv)
            self.cache.store(r, ids)
        return len(taken)

    # -- for /health and /metrics ----------------------------------------------------------------------
    def status(self) -> dict[str, int]:
        stats = self.cache.stats
        return {"rows": self.num_rows, "rows_in_use": self.scheduler.num_busy, "waiting": self.scheduler.num_waiting,
                "admitting": len(self.admissions), "cached_rows": self.cache.num_cached_rows,
                "prompt_cache_lookups": stats.num_lookups, "prompt_cache_hits": stats.num_hits,
                "prompt_cache_tokens": stats.num_cached_tokens, "decode_steps": self.num_steps,
                "cancelled": self.num_cancelled,
                "kv_bytes": self.lane.engine.kv.stats.reserved_bytes + self.rows.kv_bytes}


__all__ = ["GenerationLoop"]
