"""Calibration on real decoding traces.

The float family runs the shipped chat prompts through the real Engine and kv_manager (prefill chunks,
then greedy decoding); before each step we keep what that step reads: the valid past rows, the tokens
and their position. A recorded step is graph-independent, so it can be re-windowed for any family
member whose window holds it (left padding, the same mask rule the runtime uses) and fed to ONNX
Runtime's calibrator. The boundary ranges (KV, logits) come from every row the float model wrote.

The sink: a sequence's first token (no past) carries massive activations. In SmolLM2 its residual stream
reaches, in a few channels, values far beyond any other token's. One 16-bit range over both would give every
other token a coarse step and cost agreement with the float model, with 8- or 16-bit weights alike. So the
first token is recorded as a step of its own and calibrates a graph of its own (GraphKind.SINK); every other
step calibrates the family.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from staticlm.kv_manager import LayeredKVCache, attention_bias
from staticlm.runtime.engine.rope import RopeTable
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import KV_INPUT_ROLES, GraphShape, TensorSpec, kv_tensor_index
from staticlm.runtime.family.manifest import GraphEntry
from staticlm.runtime.model import Model
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device


@dataclass(frozen=True)
class TraceStep:
    past: np.ndarray  # [T, n, D] float32: the valid rows the step attended to (all of them, or a window of them)
    token_ids: np.ndarray  # [k] int64: the step's real tokens (k > 1: a prefill chunk)
    position: int  # rows cached before the step (calibration never slides: the first token's position)

    @property
    def is_sink(self) -> bool:
        return self.position == 0


@dataclass(frozen=True)
class Traces:
    steps: tuple[TraceStep, ...]
    kv_min: np.ndarray  # [T] over every row the float model wrote: the union of past and new ranges
    kv_max: np.ndarray  # [T]
    logits_min: float
    logits_max: float
    # The long conversation re-read in full chunks: all rows real, for GPTQ's Hessians (see _Recorder.replay)
    replay_steps: tuple[TraceStep, ...] = ()

    @property
    def sink_steps(self) -> tuple[TraceStep, ...]:
        return tuple(s for s in self.steps if s.is_sink)

    @property
    def family_steps(self) -> tuple[TraceStep, ...]:
        return tuple(s for s in self.steps if not s.is_sink)


def window_rows(past: np.ndarray, max_rows: int) -> np.ndarray:
    """[T, n, D] -> [T, min(n, max_rows), D]: what a window of max_rows rows keeps of a longer past, the first
    row (the sink) and the newest rest. Every runtime window holds row 0 and attention leans on it: without it,
    long-conversation steps reach residual peaks the runtime never sees, and widen the calibrated ranges."""
    n = past.shape[1]
    if n <= max_rows:
        return past
    return np.concatenate([past[:, :1], past[:, n - max_rows + 1:]], axis=1)


def template_entry(graphs: tuple[GraphEntry, ...]) -> GraphEntry:
    """The multi-row graph with the smallest window: every recorded step (decode tokens and prefill chunks)
    fits it as rows of one run, and its small window makes calibration cheap."""
    multi = [g for g in graphs if g.shape.ar > 1]
    pool = multi or list(graphs)
    return min(pool, key=lambda g: (-g.shape.ar, g.shape.past_len))


def calibration_prompts() -> list[str]:
    """The chat prompts the repository ships for calibration (written for this project)."""
    text = resources.files(__package__).joinpath("data/calib_prompts.json").read_text()
    return [p["prompt"] for p in json.loads(text)["prompts"]]


class _Recorder:
    """The float family on one sequence: what each step reads, and the KV and logits ranges of all it writes."""

    def __init__(self, float_dir: Path, *, max_past_rows: int | None) -> None:
        self.engine = Model.open(float_dir, RunOptions(device=Device.CPU), warm_up=False).engine
        if isinstance(self.engine.kv, LayeredKVCache):  # local layers keep every row here: steps read all of them
            self.engine.kv = self.engine.kv.keeping_all()
        self.chunk = max(self.engine.prefill_len, 1)
        self.room = self.engine.max_context - 1
        self.max_rows = max_past_rows or self.engine.max_context
        t = self.engine.kv.spec.num_tensors
        self.kv_min, self.kv_max = np.full(t, np.inf, np.float32), np.full(t, -np.inf, np.float32)
        self.logits_min, self.logits_max = np.inf, -np.inf
        self.tokens: list[int] = []  # the sequence cached now

    @property
    def num_cached(self) -> int:
        return self.engine.num_cached

    def reset(self) -> None:
        self.absorb_kv()
        self.engine.reset()
        self.tokens.clear()

    def step(self, token_ids) -> TraceStep:
        """What a run of token_ids reads now: at most max_past_rows rows (see window_rows)."""
        block = self.engine.kv.valid_block(0)
        return TraceStep(window_rows(block, self.max_rows).copy(), np.asarray(token_ids, np.int64), block.shape[1])

    def run(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64)
        self.tokens += ids.tolist()
        logits = self.engine.prefill(ids) if ids.size > 1 or self.num_cached == 0 else self.engine.decode(int(ids[0]))
        self.logits_min, self.logits_max = min(self.logits_min, float(logits.min())), max(self.logits_max,
                                                                                        float(logits.max()))
        return logits

    def replay(self) -> list[TraceStep]:
        """The cached sequence again as full chunks after its first token, with no model run: the cache holds
        each chunk's past, and attention is causal, so each row is exactly the step that wrote it. Decode steps
        give one real row a run; this gives a chunk's worth."""
        block = self.engine.kv.valid_block(0)  # [T, n, D]
        return [TraceStep(window_rows(block[:, :p], self.max_rows).copy(),
                          np.asarray(self.tokens[p:p + self.chunk], np.int64), p)
                for p in range(1, len(self.tokens) - self.chunk + 1, self.chunk)]

    def absorb_kv(self) -> None:
        block = self.engine.kv.valid_block(0)  # [T, n, D]: every row written since the last reset
        if block.shape[1]:
            np.minimum(self.kv_min, block.min(axis=(1, 2)), out=self.kv_min)
            np.maximum(self.kv_max, block.max(axis=(1, 2)), out=self.kv_max)


def record_traces(float_dir: Path, prompt_ids: list[list[int]], *, max_steps: int, max_new_tokens: int,
                  eos_ids: tuple[int, ...] = (), sink_ids: tuple[int, ...] = (), on_prompt=None,
                  max_past_rows: int | None = None) -> Traces:
    """Run the float family over the prompts; keep about max_steps steps: a quarter prefill chunks and a quarter
    decode tokens of each prompt alone, half from one long conversation of all of them (see _long_conversation;
    only when the family's context reaches past the short chats),
    plus every prompt's first token (and each of sink_ids) as a sink step of its own. A step keeps at most
    max_past_rows of its past (the calibrating graph's window)."""
    rec = _Recorder(float_dir, max_past_rows=max_past_rows)
    keep = max(rec.room - max_new_tokens, 1)  # long prompts keep their end (the assistant header), so decoding happens
    prompt_ids = [p[-keep:] for p in prompt_ids]
    reach = max(map(len, prompt_ids), default=0) + max_new_tokens  # the furthest position a short chat gets to
    num_long = max_steps // 2 if len(prompt_ids) > 1 and reach < rec.room else 0  # positions beyond it exist
    num_short = max_steps - num_long
    num_chunks = sum(-(-len(p) // rec.chunk) for p in prompt_ids)
    num_decode = len(prompt_ids) * max_new_tokens
    chunk_stride = max(1, -(-num_chunks // max(1, num_short // 2)))
    decode_stride = max(1, -(-num_decode // max(1, num_short - min(num_chunks, num_short // 2))))
    steps: list[TraceStep] = []
    sinks: list[TraceStep] = []
    chunk_no = decode_no = 0

    def first_token(token: int) -> np.ndarray:  # alone, as the runtime runs it (Engine.prefill, the sink)
        rec.reset()
        sinks.append(rec.step([token]))
        return rec.run([token])

    for token in sink_ids:  # more first tokens than the chat template's one
        first_token(token)
    for ids in prompt_ids:
        logits = first_token(ids[0])
        for start in range(1, len(ids), rec.chunk):
            part = ids[start:start + rec.chunk]
            if chunk_no % chunk_stride == 0:
                steps.append(rec.step(part))
            chunk_no += 1
            logits = rec.run(part)
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits))
            if token in eos_ids or rec.num_cached + 1 > rec.room:
                break
            if decode_no % decode_stride == 0:
                steps.append(rec.step([token]))
            decode_no += 1
            logits = rec.run([token])
        if on_prompt is not None:
            on_prompt()
    steps = steps[:num_short]
    replay: list[TraceStep] = []
    if num_long:
        steps += _long_conversation(rec, prompt_ids, num_steps=num_long, max_new_tokens=max_new_tokens,
                                    eos_ids=eos_ids)
        replay = rec.replay()
    rec.reset()
    return Traces(steps=tuple(steps) + tuple(sinks), kv_min=rec.kv_min, kv_max=rec.kv_max,
                  logits_min=rec.logits_min, logits_max=rec.logits_max, replay_steps=tuple(replay))


def _long_conversation(rec: _Recorder, prompt_ids: list[list[int]], *, num_steps: int, max_new_tokens: int,
                       eos_ids: tuple[int, ...]) -> list[TraceStep]:
    """The prompts one after another in one cache, each answered greedily, round after round until the largest
    context is full; a step every room / num_steps rows. Short chats alone reach only early positions, and
    calibrated on them alone, position-dependent activations (RoPE'd queries, attention scores) leave their
    ranges at later positions."""
    rec.reset()
    every = max(1, rec.room // num_steps)
    steps: list[TraceStep] = []
    while True:
        for ids in prompt_ids:
            for start in range(0, len(ids), rec.chunk):
                part = ids[start:start + rec.chunk]
                if rec.num_cached + len(part) > rec.room:
                    return steps[:num_steps]
                if rec.num_cached >= every * (len(steps) + 1):
                    steps.append(rec.step(part))
                logits = rec.run(part)
            for _ in range(max_new_tokens):
                token = int(np.argmax(logits))
                if token in eos_ids:
                    break
                if rec.num_cached + 1 > rec.room:
                    return steps[:num_steps]
                if rec.num_cached >= every * (len(steps) + 1):
                    steps.append(rec.step([token]))
                logits = rec.run([token])


class StepFeeds:
    """Re-windows recorded steps for one graph shape: the feeds the runtime would have bound."""

    def __init__(self, inputs: tuple[TensorSpec, ...], shape: GraphShape, *, config: ModelConfig,
                 mask_value: float) -> None:
        self.shape, self.mask_value = shape, mask_value
        self._bias = attention_bias
        self._rope = RopeTable(config)
        num_kv_heads = config.num_kv_heads
        self._kv = [(s.name, kv_tensor_index(layer=s.layer, kv_head=s.kv_head, is_value=s.role == KV_INPUT_ROLES[1],
                                             num_kv_heads=num_kv_heads), config.is_local(s.layer))
                    for s in inputs if s.role in KV_INPUT_ROLES]
        # local layers (Gemma 3): their RoPE, and their windows of the newest min(P, W-1) rows
        self._local_rope = RopeTable(config, local=True) if config.local_layers else None
        self._window = config.local_window
        self._local_past = config.layer_past_len(config.local_layers[0], shape.past_len) if config.local_layers else 0

    def select(self, steps: tuple[TraceStep, ...]) -> tuple[TraceStep, ...]:
        """Every step whose tokens fit the graph: a decode token runs as row 0 of a multi-row graph, so one
        multi-row graph calibrates the ranges of both kinds of step."""
        return tuple(s for s in steps if s.token_ids.size <= self.shape.ar) or steps

    def feeds(self, step: TraceStep, only: set[str] | None = None) -> dict[str, np.ndarray]:
        """The step's rows, then padding rows that repeat its last row exactly: the same token, position and
        mask row, so they compute that row's activations and add nothing to the calibrated ranges. The
        runtime's padding rows (the last token at the next positions, attending to each other) are dropped
        after the run, but a calibrator sees them: in SmolLM2 such repeats reach residual values far beyond
        real rows', which would coarsen the 16-bit step for every real token. only: the KV inputs to make (a layer
        group's, streamed.py), every one when None."""
        s, n = self.shape, step.position
        past = window_rows(step.past, s.past_len)
        ids = np.zeros((1, s.ar), np.int64)
        k = min(step.token_ids.size, s.ar)
        ids[0, :k] = step.token_ids[:k]
        ids[0, k:] = step.token_ids[k - 1]
        cos = np.zeros((1, 1, s.ar, past.shape[2]), np.float32)
        sin = np.zeros_like(cos)
        self._rope.fill((n + np.minimum(np.arange(s.ar), k - 1))[None], cos_out=cos, sin_out=sin)
        kept = past.shape[1]
        bias = self._bias(lengths=np.array([kept]), past_len=s.past_len, ar=s.ar)  # [1, 1, AR, P + AR]
        bias[:, :, k:] = bias[:, :, k - 1:k]
        bias[bias < 0] = self.mask_value  # the level the quantized mask input represents
        feeds = {"input_ids": ids, "rope_cos": cos, "rope_sin": sin, "attention_bias": bias}
        kv = [(name, t, local) for name, t, local in self._kv if only is None or name in only]
        local_window = self._local_feeds(step, k, feeds) if self._local_rope is not None else None
        for name, t, local in kv:
            if local:
                feeds[name] = local_window[t][None, None]
                continue
            window = np.zeros((1, 1, s.past_len, past.shape[2]), np.float32)  # [1, 1, P, D]
            if kept:
                window[0, 0, s.past_len - kept:] = past[t]  # left padding: valid rows at the right end
            feeds[name] = window
        return feeds

    def _local_feeds(self, step: TraceStep, k: int, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The local layers' RoPE rows and sliding mask into feeds; their windows [T, Pl, D] (the newest rows)."""
        s, pl = self.shape, self._local_past
        kept = min(step.position, pl, step.past.shape[1])
        cos = np.zeros_like(feeds["rope_cos"])
        sin = np.zeros_like(cos)
        self._local_rope.fill((step.position + np.minimum(np.arange(s.ar), k - 1))[None], cos_out=cos, sin_out=sin)
        bias = self._bias(lengths=np.array([kept]), past_len=pl, ar=s.ar, window=self._window)  # [1, 1, AR, Pl+AR]
        bias[:, :, k:] = bias[:, :, k - 1:k]
        bias[bias < 0] = self.mask_value
        feeds.update(rope_cos_local=cos, rope_sin_local=sin, attention_bias_local=bias)
        window = np.zeros((step.past.shape[0], pl, step.past.shape[2]), np.float32)  # [T, Pl, D]
        if kept:
            window[:, pl - kept:] = step.past[:, step.past.shape[1] - kept:]
        return window

    def iterate(self, steps: tuple[TraceStep, ...]) -> Iterator[dict[str, np.ndarray]]:
        for step in self.select(steps):
            yield self.feeds(step)


def trace_reader(step_feeds: StepFeeds, steps: tuple[TraceStep, ...]):
    """An onnxruntime CalibrationDataReader over the steps that fit the graph (lazily: windows are large)."""
    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = step_feeds.iterate(steps)

        def get_next(self):
            return next(self._it, None)

        def rewind(self) -> None:
            self._it = step_feeds.iterate(steps)

    return _Reader()
