"""Admission: a request between the queue and its rows (loop.py steps what this module places).

A waiting request that fits reserves its rows (scheduler.py), then its prompt is prefilled on the lane one chunk
per loop step, from the longest prefix the prompt cache holds (prompt_cache.py: the lane's own, or a row's copied
in once). When the prompt is in, its choices take their rows: copies of the lane's KV, or its prompt segment read
in place (rows.py), or, for a lone sequence, the lane itself.

Rows that read one prompt segment (rows.py, segments) take a request while they decode only if its prompt extends
the segment: the lane's first rows, which no prefill may change while a row reads them (the lane prefills the
newcomer's rest after them, and its rows copy just that rest). The segment is chosen when rows start reading it:
the prefix the first request shares with a waiting one (at least MIN_SHARED_PREFIX tokens), or with the lone
sequence it joins on the lane, else the whole first prompt (its choices share it).

Admitted prompts wait for the lane in the order `next_prefill` (scheduler.py) gives: the shortest first (its tokens
not in a cache), none overtaken more than MAX_OVERTAKEN times. Rows that keep their prompts (copies) let a prompt
admitted later and shorter than the rest of the one the lane is prefilling go first: the lane's rows so far are
parked in a free row of the prompt cache (one copy; no other request takes that row) and taken back (one copy)
when its turn comes again. Otherwise the prompt started runs to its end.

A greedy request on rows that would not give it the lane's bits (Rows.greedy_exact: the segments kind of a family
attending with ORT's GroupQueryAttention, beside a lane that pairs its rows) runs on the lane instead, alone, as one
sequence whose answer each of its choices gets (greedy choices are the same tokens); a prefix it shares with the
lane's last sequence comes from the lane's cache. A family attending with staticlm's own ops keeps greedy requests
in the segment's rows, beside sampled ones.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from staticlm.runtime.generate.placement import Where
from staticlm.runtime.generate.prompt_cache import PromptCache, common_prefix
from staticlm.runtime.generate.rows import Rows
from staticlm.runtime.generate.running import RunningSequence, new_sequences
from staticlm.runtime.generate.scheduler import RowScheduler, next_prefill
from staticlm.runtime.generate.sequence_request import Admitted, Failed, Finished, SequenceRequest
from staticlm.runtime.generate.text_stream import FinishReason

# A prompt segment read in place is worth sharing from this many common tokens: one step of the response buffer
# (kv_manager/segments.py), which a row's own copy of them would take anyway.
MIN_SHARED_PREFIX = 16
# Prompt chunks (the family's longest prompt graph each) prefilled per step (rows decode between). One chunk per step
# stretches a long prompt over many steps: its first token comes late, and its answer decodes on after the others
# ended, in steps with fewer rows. More chunks per step: each decoding row's step is longer for those few steps.
PREFILL_CHUNKS_PER_STEP = 4
# A prompt waits for at most this many shorter ones admitted after it (next_prefill): a bounded wait for a long
# prompt, while the short ones beside it (as many as the rows, at most, are admitted at a time) go first.
MAX_OVERTAKEN = 8


def extends(prompt: list[int], segment: list[int]) -> bool:
    """Whether a prompt starts with the segment and has a token after it (to give its own next-token logits)."""
    return len(prompt) > len(segment) and prompt[:len(segment)] == segment


def shared_prefix(tokens: list[int], prompt: list[int]) -> int:
    """The longest segment of tokens that prompt extends."""
    return min(common_prefix(tokens, prompt), len(prompt) - 1)


@dataclass(eq=False)
class Admission:
    """A request whose rows are reserved, its prompt being prefilled on the lane (todo: None until it starts)."""

    request: SequenceRequest
    num_rows: int
    todo: list[int] | None = None
    num_cached: int = 0
    num_overtaken: int = 0  # prompts admitted after it that were prefilled before it (next_prefill)
    parked_row: int | None = None  # set aside: the free row its prompt so far waits in (the prompt cache's)
    size: int | None = None  # while it waits: its tokens to prefill (before it starts, _num_to_prefill's guess)


class Admissions:
    """The admitted requests whose prompts are being prefilled, oldest first; lane, rows, scheduler and cache: the
    loop's; use_cache: whether prompts start from cached prefixes."""

    def __init__(self, *, lane, rows: Rows, scheduler: RowScheduler, cache: PromptCache, use_cache: bool) -> None:
        self.lane, self.rows, self.scheduler, self.cache = lane, rows, scheduler, cache
        self.use_cache = use_cache
        self.pending: deque[Admission] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    def schedule(self) -> bool:
        """Waiting requests that fit take their rows; their prompts queue for the lane."""
        admissible = self._admissible_on_segment() if self.rows.shares_segment else self.scheduler.admissible()
        for request, num_rows in admissible:
            self.pending.append(Admission(request, num_rows))
        return bool(admissible)

    def on_lane(self, request: SequenceRequest) -> bool:
        """Whether the request runs alone on the lane, its choices mirrored (a greedy one on rows that would not
        give it the lane's bits, Rows.greedy_exact)."""
        return self.rows.place(greedy=request.params.sampling.is_greedy) is Where.LANE

    def _admissible_on_segment(self) -> list[tuple[SequenceRequest, int]]:
        """Rows that read one prompt segment: while it is bound, the requests that extend it; else one request, and
        beside a lone sequence on the lane only one sharing at least MIN_SHARED_PREFIX tokens with it. A request
        that runs on the lane (on_lane) starts when nothing else runs, and holds it until it ends."""
        segment, scheduler = self.rows.segment, self.scheduler
        busy = scheduler.busy_rows()
        reading = any(not scheduler.occupant(r).solo for r in busy)
        if segment is not None and not reading and not self.pending:
            self.rows.unbind_segment()  # nobody reads it, nobody was admitted against it
            segment = None
        if any(self.on_lane(scheduler.occupant(r).request) for r in busy):
            return []
        head = scheduler.head()
        if head is not None and self.on_lane(head):
            return [] if busy or self.pending else scheduler.admissible(max_requests=1)
        if segment is not None:
            return scheduler.admissible(accepts=lambda r: self.use_cache and extends(r.prompt_ids, segment)
                                        and not self.on_lane(r))
        if self.pending or reading:
            return []  # the segment is chosen when that request's rows start reading it
        alone = bool(busy)  # a lone sequence decodes on the lane
        return scheduler.admissible(max_requests=1, accepts=lambda r: not alone or (
            self.use_cache and shared_prefix(self.lane.tokens, r.prompt_ids) >= MIN_SHARED_PREFIX))

    @property
    def max_prefill_tokens(self) -> int:
        """Prompt tokens a step prefills (rows decode between steps)."""
        return PREFILL_CHUNKS_PER_STEP * self.lane.engine.prefill_len

    def prefill_chunk(self) -> tuple[bool, Admission | None]:
        """Up to max_prefill_tokens of the next admitted prompt (_next) on the lane, alone too: a request that
        comes meanwhile is admitted at the next step, and a shorter prompt goes first; returns whether anything
        ran, and the admission whose prompt is now all in (its choices to be placed)."""
        if not self.pending:
            return False, None
        adm = self._next()
        try:
            if adm.todo is None:
                self.migrate_solo(for_prompt=adm.request.prompt_ids)  # the lane is needed: a lone one moves out
                if adm.parked_row is not None:
                    adm.todo = self._take_back(adm)
                else:
                    adm.todo, adm.num_cached = self._start(adm.request)
            take = min(len(adm.todo), self.max_prefill_tokens)
            take -= take > 2 and len(adm.todo) - take == 1  # leave no lone row for last (Engine.pairs_rows)
            self.lane.append_tokens(adm.todo[:take])
            del adm.todo[:take]
        except Exception as e:  # noqa: BLE001 -- the request fails, the loop keeps serving
            self.pending.remove(adm)
            self.scheduler.unreserve(adm.num_rows)
            if self.rows.segment is not None:  # what the prefill left after the segment is unknown
                self.lane.rewind_to(len(self.rows.segment))
            else:
                self.lane.reset()
            adm.request.on_event(Failed(e))
            return True, None
        if adm.todo:
            return True, None
        self.pending.remove(adm)
        return True, adm

    def _next(self) -> Admission:
        """The admission the lane prefills now (next_prefill's order): the older ones it overtakes count it, and
        the one it overtakes on the lane is parked."""
        pending = list(self.pending)
        started = next((i for i, a in enumerate(pending) if a.todo is not None), None)
        if len(pending) == 1:
            return pending[0]
        can_switch = started is not None and self._can_park(pending[started])
        if started is not None and not can_switch:
            return pending[started]
        for a in pending:
            if a.size is None:
                a.size = self._num_to_prefill(a.request.prompt_ids)
        sizes = [len(a.todo) if a.todo is not None else a.size for a in pending]
        i = next_prefill(sizes, num_overtaken=[a.num_overtaken for a in pending], max_overtaken=MAX_OVERTAKEN,
                         started=started, can_switch=can_switch)
        if i != started:
            for older in pending[:i]:
                older.num_overtaken += 1
            if started is not None:
                self._park(pending[started])
        return pending[i]

    def _can_park(self, adm: Admission) -> bool:
        """Whether the prompt the lane is prefilling can wait in a row of the prompt cache (what it has so far)."""
        done = len(adm.request.prompt_ids) - len(adm.todo)
        return (self.use_cache and self.rows.keeps_prefixes and self.rows.opened and done > 0
                and self.lane.tokens == adm.request.prompt_ids[:done] and bool(self._free_rows(but=adm)))

    def _free_rows(self, *, but: Admission | None = None) -> list[int]:
        """Free rows no other admission has parked its prompt in."""
        parked = {a.parked_row for a in self.pending if a is not but}
        return [r for r in self.scheduler.free_rows() if r not in parked]

    def _park(self, adm: Admission) -> None:
        """The lane's rows so far of adm's prompt wait in a free row (one copy) until it is prefilled again."""
        row = self.cache.victims(1, free=self._free_rows(but=adm))[0]
        self.rows.load([row], self.lane.engine)
        self.cache.store(row, self.lane.tokens)
        adm.todo, adm.parked_row, adm.size = None, row, len(adm.todo)

    def _take_back(self, adm: Admission) -> list[int]:
        """A parked prompt's rows so far back on the lane (one copy, unless the lane still holds them); returns
        what is left to prefill. A row that lost them (a failed step resets the rows) gives back what it still
        holds, and the rest is prefilled again."""
        ids, row, lane = adm.request.prompt_ids, adm.parked_row, self.lane
        num_in_row = min(common_prefix(self.cache.tokens(row), ids), len(ids) - 1)
        if num_in_row > common_prefix(lane.tokens, ids):
            lane.adopt(self.rows.engine, row=row, token_ids=ids[:num_in_row])
        adm.parked_row = None  # its rows start there (PromptCache.victims: the row its prompt repeats)
        return lane.sync_prefix(list(ids))

    def _num_to_prefill(self, ids: list[int]) -> int:
        """The prompt's tokens that no cache _start would look in holds (the lane's, or a free row's)."""
        cached = common_prefix(self.lane.tokens, ids) if self.use_cache else 0
        if self.use_cache and self.rows.keeps_prefixes:
            cached = max(cached, self.cache.longest(ids, rows=self.scheduler.free_rows())[1])
        return len(ids) - min(cached, len(ids) - 1)

    def _start(self, request: SequenceRequest) -> tuple[list[int], int]:
        """Rewind the lane to the longest cached prefix of the prompt (its own, or a row's copied in once)."""
        ids, lane, source = request.prompt_ids, self.lane, None
        if self.rows.segment is not None and not extends(ids, self.rows.segment):  # _admissible_on_segment's rule
            raise RuntimeError("a prompt that does not extend the bound segment would overwrite the rows it reads")
        if not self.use_cache:
            lane.reset()
        elif self.rows.keeps_prefixes:
            source, num_in_row = self.cache.longest(ids, rows=self.scheduler.free_rows())
            for r in self.scheduler.busy_rows():  # a row still decoding holds its prompt too (a shared system prompt)
                seq = self.scheduler.occupant(r)
                n = 0 if seq.solo else common_prefix(seq.request.prompt_ids + seq.stream.ids[:seq.num_fed], ids)
                if n > num_in_row:
                    source, num_in_row = r, n
            num_on_lane = common_prefix(lane.tokens, ids)
            if source is not None and num_in_row > num_on_lane:
                lane.adopt(self.rows.engine, row=source, token_ids=ids[:min(num_in_row, len(ids) - 1)])
            if source is not None and num_in_row >= num_on_lane:
                self.cache.touch(source)  # its prefix serves this prompt: the last row LRU evicts
        todo = lane.sync_prefix(list(ids))
        num_cached = len(ids) - len(todo)
        self.cache.record(num_cached=num_cached)
        request.on_event(Admitted(num_prompt_tokens=len(ids), num_cached_tokens=num_cached,
                                  time=time.perf_counter()))
        return todo, num_cached

    def place(self, adm: Admission) -> tuple[list[int], list[RunningSequence]]:
        """The prefilled request's choices take their rows (the lane's KV loaded into them, unless one choice runs
        alone on the lane); returns the rows and their sequences."""
        request, on_lane = adm.request, self.on_lane(adm.request)
        seqs = new_sequences(request, tokenizer=self.lane.tokenizer, prompt_ids=request.prompt_ids, mirrored=on_lane)
        self.scheduler.unreserve(adm.num_rows - len(seqs))  # a mirrored request's other choices take no row
        solo = on_lane or (adm.num_rows == 1 and not self.scheduler.busy_rows() and not self.pending
                           and not self.scheduler.num_waiting) or not self.rows.available
        free = self._free_rows(but=adm)
        rows = (self.cache.victims(adm.num_rows, free=free, prompt=request.prompt_ids) if self.rows.keeps_prefixes
                else free[:len(seqs)])
        for r, seq in zip(rows, seqs, strict=True):
            self.cache.forget(r)
            seq.solo = solo
            self.scheduler.occupy(r, seq)
        if self.rows.shares_segment and solo:
            self.rows.unbind_segment()  # no row reads it (busy rows would have made this one a row too)
        elif self.rows.shares_segment and self.rows.segment is None:
            self._bind_segment(self._segment_len(request.prompt_ids))
        if not solo:
            self.rows.load(rows, self.lane.engine)
        return rows, seqs

    def _segment_len(self, prompt: list[int]) -> int:
        """The segment of a prompt on the lane whose choices start the rows: the prefix a waiting request shares
        with it, or else all of it."""
        shared = max((shared_prefix(prompt, r.prompt_ids) for r in self.scheduler.waiting()), default=0)
        return shared if self.use_cache and shared >= MIN_SHARED_PREFIX else len(prompt)

    def _bind_segment(self, num_tokens: int) -> None:
        self.rows.bind_segment(self.lane.engine, self.lane.tokens[:num_tokens])

    def migrate_solo(self, *, for_prompt: list[int] | None = None) -> None:
        """A sequence decoding alone on the lane moves into its row: one copy of its KV (rows that read a prompt
        segment: of its rows after the prefix it shares with for_prompt, the prompt about to join it)."""
        for r in self.scheduler.busy_rows():
            seq = self.scheduler.occupant(r)
            if seq.solo and self.rows.available:
                if self.rows.shares_segment:
                    tokens = self.lane.tokens
                    shared = shared_prefix(tokens, for_prompt) if for_prompt is not None else 0
                    self._bind_segment(shared if shared >= MIN_SHARED_PREFIX else len(tokens))
                self.rows.load([r], self.lane.engine)
                seq.solo = False

    def reap_cancelled(self, *, now: float) -> None:
        """Admitted or waiting requests whose client went away end before they take a row."""
        for adm in [a for a in self.pending if a.request.cancelled]:
            self.pending.remove(adm)
            self.scheduler.unreserve(adm.num_rows)
            _cancelled(adm.request, now=now)
        for request in self.scheduler.waiting():
            if request.cancelled and self.scheduler.drop_waiting(request):
                _cancelled(request, now=now)


def _cancelled(request: SequenceRequest, *, now: float) -> None:
    """A request that ended before any of its choices had a row."""
    for choice in range(request.num_choices):
        request.on_event(Finished(choice=choice, reason=FinishReason.CANCELLED, token_ids=(), text="", time=now))
