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

from .engine import Engine
from .sampling import sample
from .text_stream import FinishReason, GenerationParams, TextStream
from .tokenizer import Tokenizer


@dataclass
class Response:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    first_token_s: float  # since the request started
    last_token_s: float


class BatchGenerator:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, num_responses: int, speculator=None) -> None:
        if num_responses < 2:
            raise InvalidOption(f"--num-responses must be >= 2 for a batch, got {num_responses}")
        self.engine, self.tokenizer = engine, tokenizer
        self.batch = Engine(engine.model_dir, options=engine.options, batch=num_responses, weights_from=engine)
        self.speculator = speculator  # a BatchSpeculator, or None
        if speculator is not None and not self.batch.verify_lens:
            raise InvalidOption(f"{engine.model_dir} has no batched verify graphs for {num_responses} responses: "
                                f"export it with --batch-sizes {num_responses}")
        self.rng = np.random.default_rng()

    def generate(self, prompt_ids: list[int], params: GenerationParams, *,
                 on_text: Callable[[int, str], None] = lambda seq, text: None,
                 should_stop: Callable[[], bool] = lambda: False) -> list[Response]:
        if not prompt_ids:
            raise InvalidOption("the prompt is empty")
        if params.sampling.seed is not None:
            self.rng = np.random.default_rng(params.sampling.seed)
        t0 = time.perf_counter()
        num = self.batch.batch
        self.engine.reset()
        logits = self.engine.prefill(prompt_ids)
        self.batch.load_prefix(self.engine)
        streams = [TextStream(self.tokenizer, params) for _ in range(num)]
        # Per sequence, tokens to show: all but the last are already in the cache; the last is pending.
        fresh = [[sample(logits, params.sampling, rng=self.rng, history=prompt_ids)] for _ in range(num)]
        last = np.zeros(num, np.int64)  # [B] the pending tokens
        active = np.ones(num, bool)
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
            contexts = [prompt_ids + s.ids for s in streams]
            fresh = self.speculator.step(self.batch, last, active=active, contexts=contexts, params=params.sampling,
                                         rng=self.rng)
            if fresh is not None:
                return fresh
        out = self.batch.decode_batch(last, active=active)  # [B, V]
        return [[sample(out[seq], params.sampling, rng=self.rng, history=prompt_ids + streams[seq].ids)]
                if active[seq] else [] for seq in range(len(streams))]
