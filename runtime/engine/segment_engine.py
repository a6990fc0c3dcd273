"""Several responses on segmented graphs: the prompt's K/V read in place from the engine that prefilled it.

SegmentEngine is a BatchEngine (batch_engine.py) like a batched Engine (load_prefix, decode_batch, verify, commit,
...), run by the loop's rows (rows.py) and BatchSpeculator, but holds no copy of the prompt: `load_prefix` binds the
prompt engine's cached rows as the shared prompt segment and starts an empty ResponseCache for the responses' own
rows (kv_manager/segments.py).
The response buffer, read whole by the graphs, grows SEGMENT_STEP rows at a time (a cpu family: the graphs'
response length climbs a ladder of that step) or from rung to rung of the graphs' static response lengths (an HTP
family); segment_layout.py holds the difference.
"""
from __future__ import annotations

import time

import numpy as np

from staticlm.kv_manager import ContextFull, KVSpec, Overflow
from staticlm.kv_manager.segments import SEGMENT_STEP, ResponseCache, SegmentKV
from staticlm.runtime.engine import steps
from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.engine.ladder import rung_past_len
from staticlm.runtime.engine.runner import FamilyContext
from staticlm.runtime.engine.segment_layout import segment_layout
from staticlm.runtime.engine.segment_runner import SegmentRunner
from staticlm.runtime.engine.steps import StepCounters
from staticlm.runtime.family.contract import Role
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest
from staticlm.runtime.session.sessions import GraphSessions


def has_segments(engine: Engine, batch: int) -> bool:
    """Whether the family has segmented graphs for `batch` rows that can run with this engine's prompt cache."""
    graphs = engine.manifest.graphs_of(GraphKind.SEGMENT, batch=batch)
    # a graph's prompt segment is the prompt cache's rows as they are: same element type (quantized KV: same
    # parameters, boundary_params); a slid prompt has no fixed segment
    return (bool(graphs) and all(s.dtype == engine.manifest.kv_dtype for g in graphs for s in g.inputs
                                 if s.role is Role.PROMPT_KEY) and engine.options.overflow is Overflow.ERROR)


class SegmentEngine:
    """A BatchEngine (batch_engine.py) of `batch` rows on the family's segmented graphs.

    manifest: the family's; sessions: the ones the prompt's engine opens its graphs with (one weight mapping);
    family: what every runner of the family shares; max_context: the prompt's engine's, prompt rows included.
    """

    def __init__(self, *, manifest: Manifest, sessions: GraphSessions, family: FamilyContext, batch: int,
                 max_context: int) -> None:
        self.manifest, self.sessions, self.family = manifest, sessions, family
        self.model_dir, self.config = sessions.model_dir, family.config
        self.layout = segment_layout(self.manifest.graphs_of(GraphKind.SEGMENT, batch=batch), self.config)
        if 1 not in self.layout.ars:
            raise ValueError(f"{self.model_dir} has no segmented decode graph for batch {batch}")
        self.batch = batch
        self.verify_lens = tuple(ar for ar in self.layout.ars if ar > 1)
        self.max_context = max_context
        self.kv: ResponseCache | None = None
        self.segments: SegmentKV | None = None
        self._runners: dict[str, SegmentRunner] = {}
        self.counters = StepCounters()

    @classmethod
    def beside(cls, engine: Engine, *, batch: int) -> SegmentEngine:
        """The segmented graphs of engine's family, on engine's sessions, for prompts engine prefills."""
        return cls(manifest=engine.manifest, sessions=engine.sessions, family=engine.family, batch=batch,
                   max_context=engine.max_context)

    # -- graphs -------------------------------------------------------------------------
    def runner(self, entry: GraphEntry) -> SegmentRunner:
        if entry.name not in self._runners:
            session = self.sessions.shared(entry, prepack=True)
            self._runners[entry.name] = SegmentRunner(session, entry, family=self.family)
        return self._runners[entry.name]

    def warm_up(self, *, verify: bool = True) -> None:
        """Open the decode graph's session now (and the verify graphs' when verify), at the response buffer's first
        size, so no answer pays for it."""
        rows = (self.layout.rungs or (SEGMENT_STEP,))[0]
        first = max(rows, -(-max(self.verify_lens, default=1) // SEGMENT_STEP) * SEGMENT_STEP)
        for ar in (1, *self.verify_lens) if verify else (1,):
            self.runner(self.layout.entry(ar, num_prompt=1, capacity=first))

    # -- requests -----------------------------------------------------------------------
    def load_prefix(self, source: Engine) -> None:
        """Every sequence starts from source's cached rows, read in place: nothing is copied."""
        self.bind(source, num_prompt=source.num_cached)

    def bind(self, source: Engine, *, num_prompt: int) -> None:
        """source's first num_prompt cached rows become the prompt segment every row reads in place (source may
        append and rewind rows after them meanwhile, never change them); every row starts empty."""
        prompt = source.kv
        max_past = max(1, self.max_context - 1 - num_prompt)  # a full context is refused by check_room, as in Engine
        spec = KVSpec(num_tensors=prompt.spec.num_tensors, head_dim=prompt.spec.head_dim, dtype=prompt.spec.dtype,
                      max_past=max_past, max_ar=max(self.verify_lens, default=1),
                      max_positions=self.config.max_positions, batch=self.batch,
                      pad_values=prompt.spec.pad_values, heads_per_buffer=self.layout.heads_per_buffer)
        self.kv = ResponseCache(spec, step=SEGMENT_STEP, rungs=self.layout.rungs)
        self.segments = SegmentKV(prompt, self.kv, num_prompt_rows=num_prompt)

    def load_suffix(self, seq: int, source: Engine) -> None:
        """Sequence seq starts over from source's cached rows after the prompt segment (a request whose prompt
        extends the segment: its own rows, one copy per request; the segment's are read in place)."""
        rows = source.kv.valid_block(0)[:, self.segments.num_prompt_rows:]  # [T, n, D]
        self.kv.clear(seq)
        if rows.shape[1]:
            self.kv.reserve(rows.shape[1])
            self.kv.load(seq, rows)

    def reset(self) -> None:
        if self.kv is not None:
            self.kv.reset()

    @property
    def kv_bytes(self) -> int:
        """KV bytes the responses hold: the prompt's rows once and the response buffer (0 before load_prefix)."""
        return self.segments.kv_bytes if self.segments is not None else 0

    @property
    def num_cached(self) -> int:
        """Rows cached (the longest sequence's), the prompt included."""
        return self.segments.num_prompt_rows + int(self.kv.lengths.max())

    def check_room(self, num_new: int) -> None:
        if self.num_cached + num_new > self.max_context:
            raise ContextFull(f"context full: {self.num_cached} cached + {num_new} new tokens exceed the largest "
                              f"context {self.max_context}; export larger --context sizes")

    # -- steps --------------------------------------------------------------------------
    def _run(self, ar: int, tokens: np.ndarray) -> np.ndarray:
        """tokens [B, n], n <= AR real rows (the rest pad); logits [B, AR, V], nothing committed."""
        kv = self.kv
        kv.prepare(past_len=rung_past_len(int(kv.lengths.max()), step=SEGMENT_STEP, max_past=kv.spec.max_past),
                   ar=ar)
        runner = self.runner(self.layout.entry(ar, num_prompt=self.segments.num_prompt_rows,
                                               capacity=kv.capacity))  # the graph reads the whole buffer
        num_real = tokens.shape[-1]
        runner.input_ids[:, :num_real] = tokens
        runner.input_ids[:, num_real:] = runner.input_ids[:, num_real - 1:num_real]  # see Engine._run
        return runner.run(self.segments)

    def decode_batch(self, token_ids: np.ndarray, *, active: np.ndarray,
                     previous: np.ndarray | None = None) -> np.ndarray:
        """One token per sequence in, logits [B, V] out; inactive sequences commit nothing. (previous: unused,
        segmented graphs have static row counts, see Engine.pairs_rows.)"""
        self.check_room(1)
        t0 = time.perf_counter()
        logits = self._run(1, np.asarray(token_ids, np.int64).reshape(self.batch, 1))
        self.kv.advance(active.astype(np.int64))
        self.counters.num_decode_steps += 1
        self.counters.decode_seconds += time.perf_counter() - t0
        return logits[:, 0]

    def verify_len(self, num_tokens: int) -> int | None:
        for ar in self.verify_lens:
            if ar >= num_tokens and self.num_cached + ar <= self.max_context:
                return ar
        return None

    def verify(self, token_ids, *, num_real: np.ndarray | None = None) -> np.ndarray:
        """Score [B, n] tokens in one call, committing nothing (steps.verify); logits [B, n, V]."""
        return steps.verify(self, token_ids, num_real=num_real, run=self._run)

    def verify_cost_ratio(self, ar: int | None) -> float | None:
        return self.counters.verify_cost_ratio(ar)

    def commit(self, num_tokens: int | np.ndarray) -> None:
        self.kv.advance(num_tokens)
