"""The loop's batch rows: the sequences that decode together, one engine call per step for all of them.

Two kinds, chosen from the family (loop.py calls them the same way):
- copies: a batched Engine over the lane's weights; each row gets its own copy of its prompt's KV once
  (`load_row`), so requests join and leave at any step and a finished row's KV serves the prompt cache;
- segments: the family's segmented graphs read the lane's prompt KV in place (segment_engine.py): the prompt
  segment, the lane's first rows, held once; each row holds only what its request adds after it (the rest of its
  prompt, copied once, and its answer). A request's choices share it, and so do requests whose prompts extend it
  (a cached prefix: admission.py decides which). An HTP family's batched graphs are all of this kind; a cpu family
  uses them when `--shared-prompt-kv` asks.
A family with neither has no rows: every sequence decodes on the lane, one at a time.
"""
from __future__ import annotations

import numpy as np

from staticlm.errors import InvalidOption
from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.engine.segment_engine import SegmentEngine, has_segments
from staticlm.runtime.family.manifest import GraphKind
from staticlm.runtime.generate.loop_parts import LoopParts
from staticlm.runtime.generate.placement import (
    FamilyFacts,
    Where,
    greedy_exact,
    num_rows,
    pairs_batch_step,
    place,
    rows_kind,
)
from staticlm.runtime.generate.running import RunningSequence


def family_facts(lane: Engine, *, shared_prompt_kv: bool) -> FamilyFacts:
    """What placement.py reads of the lane's family and the run options."""
    copies = max((g.shape.batch for g in lane.manifest.graphs if g.kind is GraphKind.DECODE), default=1)
    segmented = max((g.shape.batch for g in lane.manifest.graphs if g.kind is GraphKind.SEGMENT), default=1)
    return FamilyFacts(num_copy_rows=copies, num_segment_rows=segmented,
                       can_segment=segmented > 1 and has_segments(lane, segmented),
                       exact_attention=lane.manifest.exact_attention, pairs_rows=lane.pairs_rows,
                       shared_prompt_kv=shared_prompt_kv)


class Rows:
    def __init__(self, parts: LoopParts, *, eager: bool = False, kind: str | None = None) -> None:
        """kind: "copies" or "segments" to compare them (a benchmark); None: the family's and the options' choice."""
        self.parts = parts
        lane = parts.lane.engine
        self.facts = family_facts(lane, shared_prompt_kv=parts.shared_prompt_kv)
        self.kind = rows_kind(self.facts, forced=kind)
        self.num_rows = num_rows(self.facts, self.kind)
        self.unavailable = (None if self.kind else
                            f"{lane.model_dir}: its batched graphs read one shared prompt segment, which --on-overflow "
                            "slide cannot keep; use --on-overflow error, or one response at a time"
                            if self.facts.num_segment_rows > 1
                            else f"{lane.model_dir} has no batched graphs for several responses: export it with "
                            "--batch-sizes")
        self._engine: Engine | SegmentEngine | None = None
        self.segment: list[int] | None = None  # segments: the tokens of the prompt segment the rows read, if bound
        self._step = _StepInputs(self.num_rows)
        self.speculator = None
        if eager and self.kind is not None:
            self.open()

    @property
    def available(self) -> bool:
        return self.kind is not None

    @property
    def opened(self) -> bool:
        return self._engine is not None

    @property
    def keeps_prefixes(self) -> bool:
        """Whether each row holds its own prompt (the prompt cache's rows)."""
        return self.kind == "copies"

    @property
    def greedy_exact(self) -> bool:
        """Whether a greedy row gets here the bits the lane would give it (tests/test_greedy_paths.py). A family
        whose graphs attend with staticlm's own ops (Manifest.exact_attention) computes every query row alone, in
        the segmented graphs as in the lane's. Otherwise the segmented graphs sum attention with nodes of their own,
        the prompt segment, the response buffer and the new rows apart, where the lane's GroupQueryAttention sums
        one buffer: the last bits differ, and the linears' int8 activations carry them into the logits. Where the
        lane keeps the promise (Engine.pairs_rows), a greedy request on such rows runs on the lane instead
        (admission.py; the rule: placement.greedy_exact)."""
        return greedy_exact(self.facts, self.kind)

    def place(self, *, greedy: bool) -> Where:
        """Where a request's choices decode (placement.place)."""
        return place(self.facts, self.kind, greedy=greedy)

    @property
    def shares_segment(self) -> bool:
        """Whether the rows read one prompt segment (a request joins busy rows only if its prompt extends it)."""
        return self.kind == "segments"

    def bind_segment(self, lane: Engine, tokens: list[int]) -> None:
        """The lane's first len(tokens) cached rows (these tokens) become the prompt segment; every row empties."""
        self.engine.bind(lane, num_prompt=len(tokens))
        self.segment = list(tokens)

    def unbind_segment(self) -> None:
        """No row reads the segment any more: the lane may change any of its rows."""
        self.segment = None

    @property
    def engine(self) -> Engine | SegmentEngine:
        return self._engine if self._engine is not None else self.open()

    def open(self) -> Engine | SegmentEngine:
        lane, speculates = self.parts.lane.engine, self.parts.speculates
        if self.kind == "segments":
            self._engine = SegmentEngine.beside(lane, batch=self.num_rows)
        else:
            self._engine = Engine(lane.model_dir, options=lane.options, batch=self.num_rows, weights_from=lane)
        if speculates and not self._engine.verify_lens:
            raise InvalidOption(f"{lane.model_dir} has no batched verify graphs for {self.num_rows} rows: " + (
                "its segmented graphs have no verify length (exported with --verify-lens none); run several "
                "responses without --speculate" if self.kind == "segments"
                else f"export it with --batch-sizes {self.num_rows}"))
        self._engine.warm_up(verify=speculates)
        self.speculator = self.parts.speculator(num_sequences=self.num_rows, engine=self._engine)
        return self._engine

    @property
    def kv_bytes(self) -> int:
        return 0 if self._engine is None else self._engine.kv_bytes

    @property
    def copied_bytes(self) -> int:
        """KV bytes the rows' cache copied (loading prompts in, and any compaction)."""
        return 0 if self._engine is None else int(self._engine.kv.stats.copied_bytes)

    def load(self, rows: list[int], lane: Engine) -> None:
        """The lane's cached rows become these rows' start: one copy per row (copies), or the rows after the bound
        prompt segment (segments: nothing when the segment is all of them)."""
        if self.kind == "segments":
            if self.segment is None:
                raise RuntimeError("no prompt segment is bound (bind_segment)")
            for r in rows:
                self.engine.load_suffix(r, lane)
            return
        for r in rows:
            self.engine.load_row(r, lane)

    def reset(self) -> None:
        self.segment = None
        if self._engine is not None:
            self._engine.reset()

    def step(self, seqs: dict[int, RunningSequence]) -> dict[int, list[int] | np.ndarray]:
        """Run every sequence's pending token: per row, the speculated tokens, or its logits [V] to choose from
        (the dict and the logits are reused by the next step)."""
        engine, step = self.engine, self._step
        step.active[:] = False
        step.pending[:] = step.previous[:] = next(iter(seqs.values())).pending  # idle rows: any id
        for r, seq in seqs.items():
            step.active[r], step.pending[r], step.previous[r] = True, seq.pending, seq.previous
        out = step.out
        out.clear()
        # Rows run beside their previous token only where a greedy row needs the bits (RunningSequence.exact): a
        # paired step puts twice the rows through every linear layer, whose time grows with its rows on the CPU
        paired = pairs_batch_step(s.exact for s in seqs.values())
        # Without --speculate the speculator only drafts into the row a paired step pays for anyway (Model.speculator)
        drafts = paired or self.parts.speculates
        if self.speculator is not None and drafts and all(s.plain for s in seqs.values()):
            for r in range(self.num_rows):
                seq = seqs.get(r)
                step.contexts[r] = seq.history if seq is not None else _NO_CONTEXT
                step.params[r] = seq.request.params.sampling if seq is not None else None
                step.rngs[r] = seq.rng if seq is not None else None
            tokens = self.speculator.step(engine, step.pending, active=step.active, contexts=step.contexts,
                                          params=step.params, rngs=step.rngs)
            if tokens is not None:
                out.update((r, tokens[r]) for r in seqs)
                return out
        logits = engine.decode_batch(step.pending, active=step.active,
                                     previous=step.previous if paired else None)  # [B, V]
        out.update((r, logits[r]) for r in seqs)
        return out


_NO_CONTEXT: list[int] = []  # an idle row's context (the speculator drafts nothing for it)


class _StepInputs:
    """What every step hands the engine, allocated once per Rows (no per-step arrays or lists)."""

    def __init__(self, num_rows: int) -> None:
        self.active = np.zeros(num_rows, bool)  # [B] rows that hold a sequence
        self.pending = np.zeros(num_rows, np.int64)  # [B] each row's token to feed
        self.previous = np.zeros(num_rows, np.int64)  # [B] the last token each row's KV holds
        self.contexts: list[list[int]] = [_NO_CONTEXT] * num_rows  # the speculator's view of each row
        self.params: list = [None] * num_rows
        self.rngs: list = [None] * num_rows
        self.out: dict[int, list[int] | np.ndarray] = {}


__all__ = ["Rows"]
