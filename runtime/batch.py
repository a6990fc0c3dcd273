"""Several responses to one prompt: the prompt is prefilled once, then B sequences decode together.

Every batched step reads the weights once for all B sequences; each sequence keeps its own KV window
(its own `end` in the kv_manager's buffer), so lengths are ragged. A finished sequence's row is masked:
it commits nothing more and its output is ignored, and its response is final as soon as it ends.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from staticlm.errors import InvalidOption

from .batch_engine import BatchEngine
from .engine import Engine
from .family.manifest import GraphKind
from .sampling import sample
from .segment_engine import SegmentEngine, has_segments
from .text_stream import FinishReason, GenerationParams, TextStream
from .tokenizer import Tokenizer


@dataclass
class Response:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    first_token_s: float  # since the request started
    last_token_s: float


def batch_rows(batch_sizes: tuple[int, ...], num_responses: int, *, model_dir: object) -> int:
    """The exported batch size that serves num_responses: the smallest that holds them all in one round (its other
    rows stay idle), else the largest, in several rounds."""
    sizes = sorted(b for b in batch_sizes if b > 1)
    if not sizes:
        raise InvalidOption(f"{model_dir} has no batched graphs for several responses: export it with --batch-sizes")
    return next((b for b in sizes if b >= num_responses), sizes[-1])


class BatchGenerator:
    """num_rows: the batched graphs' batch size (see batch_rows); any number of responses runs on them."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, num_rows: int, speculator=None,
                 segments: bool = False) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        # segments: the family's segmented graphs read the prompt's K/V in place (segment_engine.py); else (or
        # without them) every row gets its own copy of the prompt. An HTP family's batched graphs are all segmented.
        copies = bool(engine.manifest.graphs_of(GraphKind.DECODE, batch=num_rows))
        segments = (segments or not copies) and has_segments(engine, num_rows)
        if not (segments or copies):
            raise InvalidOption(f"{engine.model_dir}: its batched graphs read one shared prompt segment, which "
                                "--on-overflow slide cannot keep; use --on-overflow error, or one response at a time")
        self.batch: BatchEngine = (
            SegmentEngine.beside(engine, batch=num_rows) if segments
            else Engine(engine.model_dir, options=engine.options, batch=num_rows, weights_from=engine))
        self.speculator = speculator  # a BatchSpeculator, or None
        if speculator is not None and not self.batch.verify_lens:
            raise InvalidOption(f"{engine.model_dir} has no batched verify graphs for {num_rows} rows: " + (
                "its segmented graphs have no verify length (exported with --verify-lens none); run several "
                "responses without --speculate" if segments
                else f"export it with --batch-sizes {num_rows}"))
        self.rng = np.random.default_rng()

    @property
    def kv_bytes(self) -> int:
        """KV bytes the responses hold: the prompt once plus the response buffers (segmented), else the batched
        cache's buffer (a copy of the prompt in every row)."""
        if isinstance(self.batch, SegmentEngine):
            return self.batch.segments.kv_bytes if self.batch.segments is not None else 0
        return self.batch.kv.stats.reserved_bytes

    def generate(self, prompt_ids: list[int], params: GenerationParams, *, num_responses: int | None = None,
                 on_text: Callable[[int, str], None] = lambda seq, text: None,
                 should_stop: Callable[[], bool] = lambda: False) -> list[Response]:
        """num_responses answers (default: one per row), in rounds of the graphs' rows; the prompt is prefilled
        once and shared by the rows (segmented graphs) or copied into them once per round."""
        num_responses = self.batch.batch if num_responses is None else num_responses
        if num_responses < 1:
            raise InvalidOption(f"--num-responses must be >= 1, got {num_responses}")
        if not prompt_ids:
            raise InvalidOption("the prompt is empty")
        if params.sampling.seed is not None:
            self.rng = np.random.default_rng(params.sampling.seed)
        t0 = time.perf_counter()
        self.engine.reset()
        logits = self.engine.prefill(prompt_ids)
        responses: list[Response] = []
        while len(responses) < num_responses:
            first = len(responses)
            num_active = min(self.batch.batch, num_responses - first)
            responses += self._round(logits, prompt_ids, params, num_active=num_active, t0=t0,
                                     on_text=lambda seq, text, first=first: on_text(first + seq, text),
                                     should_stop=should_stop)
            if any(r.finish_reason is FinishReason.CANCELLED for r in responses):
                break
        return responses

    def _round(self, logits: np.ndarray, prompt_ids: list[int], params: GenerationParams, *, num_active: int,
               t0: float, on_text: Callable[[int, str], None], should_stop: Callable[[], bool]) -> list[Response]:
        """One round: the first num_active rows answer, the rest stay idle (they commit nothing)."""
        num = self.batch.batch
        self.batch.load_prefix(self.engine)
        streams = [TextStream(self.tokenizer, params) for _ in range(num_active)]
        # Per sequence, tokens to show: all but the last are already in the cache; the last is pending.
        fresh = [[sample(logits, params.sampling, rng=self.rng, history=prompt_ids)] for _ in range(num_active)]
        fresh += [[] for _ in range(num - num_active)]
        last = np.full(num, prompt_ids[-1], np.int64)  # [B] the pending tokens (idle rows: the prompt's last)
        active = np.arange(num) < num_active  # [B]
        while True:
            now = time.perf_counter() - t0
            for seq in np.flatnonzero(active).tolist():
                last[seq] = fresh[seq][-1]
                for token in fresh[seq]:
                    text = streams[seq].push(token, now=now)
                    if text:
                        on_text(seq, text)
                    if streams[seq].reason is not None:
                        active[seq] = False
                        break
            if not active.any():
                break
            if should_stop():
                for seq in np.flatnonzero(active).tolist():
                    text = streams[seq].cancel()
                    if text:
                        on_text(seq, text)
                break
            fresh = self._step(last, active=active, prompt_ids=prompt_ids, streams=streams, params=params)
        return [Response(token_ids=s.ids, text=s.text, finish_reason=s.reason,
                         first_token_s=s.first_s, last_token_s=s.last_s) for s in streams]

    def _step(self, last: np.ndarray, *, active: np.ndarray, prompt_ids: list[int], streams: list[TextStream],
              params: GenerationParams) -> list[list[int]]:
        """One batched call: a verify step when speculation runs and pays, else one decode step."""
        if self.speculator is not None:
            contexts = [prompt_ids + s.ids for s in streams] + [prompt_ids] * (len(active) - len(streams))
            fresh = self.speculator.step(self.batch, last, active=active, contexts=contexts, params=params.sampling,
                                         rng=self.rng)
            if fresh is not None:
                return fresh
        out = self.batch.decode_batch(last, active=active)  # [B, V]
        return [[sample(out[seq], params.sampling, rng=self.rng, history=prompt_ids + streams[seq].ids)]
                if active[seq] else [] for seq in range(len(active))]
