"""The model runner: prefill and decode over a graph family, KV in the kv_manager's buffers."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from staticlm.kv_manager import ContextFull, KVSpec, Overflow, Strategy, make_kv_cache
from staticlm.runtime.engine.ladder import ladder_step, rung_past_len
from staticlm.runtime.engine.layout import LAYOUTS
from staticlm.runtime.engine.parts import chain_runner, part_entries
from staticlm.runtime.engine.rope import RopeTable
from staticlm.runtime.engine.runahead import Runahead
from staticlm.runtime.engine.runner import FamilyContext, Runner
from staticlm.runtime.family.contract import Role, graph_io, in_place_graph_io, local_tensors, num_kv_tensors
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest, load_manifest
from staticlm.runtime.family.weights import SharedWeights
from staticlm.runtime.session.device import Device, DeviceOptions, resolve_device
from staticlm.runtime.session.memory import check_memory
from staticlm.runtime.session.prepacked import store_dir
from staticlm.runtime.session.sessions import GraphSessions


@dataclass(frozen=True)
class EngineOptions:
    device: DeviceOptions = field(default_factory=DeviceOptions)
    kv_strategy: Strategy = Strategy.POINTER
    kv_reserve: float = 2.0
    overflow: Overflow = Overflow.ERROR
    bmc_r: int | None = None
    share_weights: bool = True  # one weight mapping for all CPU sessions (see shared_weights.py)
    prepack: bool = False  # multi-row graphs keep a repacked weight copy each: faster batches/verify, more memory
    run_parts: bool = False  # run every graph as its chain of layer-group parts (a family exported with --parts N)
    prefill_workers: int = 1  # KV-Runahead: workers that prefill a long prompt's chunks in parallel (runahead.py)
    # Rows of a prompt chunk where the family's graph takes any number (one in-place file); None: the family's
    # exported prefill length. Each chunk reads every weight once, so long prompts want long chunks.
    prefill_rows: int | None = None
    # Greedy answers that depend on the tokens only (see Engine.pairs_rows): on a family whose graph takes any
    # number of rows, no row runs alone, so every row takes the same kernels wherever it comes from.
    paired_rows: bool = True


def _with_rows(chunks: tuple[GraphEntry, ...], rows: int | None, *, config, kv_dtype: str,
               all_rows: bool = False) -> tuple[GraphEntry, ...]:
    """The prompt-chunk entries at `rows` rows, where their graph takes any number (a logits_index input), scoring
    the last real row (all_rows: every row, to verify drafts)."""
    if rows is None or not chunks or not any(s.role is Role.LOGITS_INDEX for s in chunks[0].inputs):
        return chunks
    out = []
    for entry in chunks:
        shape = dataclasses.replace(entry.shape, ar=rows)
        inputs, outputs = in_place_graph_io(config, shape, last_logits_only=not all_rows, kv_dtype=kv_dtype)
        out.append(dataclasses.replace(entry, name=f"{entry.name}@ar{rows}{'+' if all_rows else ''}", shape=shape,
                                       inputs=inputs, outputs=outputs))
    return tuple(out)


@dataclass
class StepCounters:
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_verify_steps: int = 0
    num_verify_rows: int = 0  # rows the verify graphs computed (real drafts + padding)
    num_verify_tokens: int = 0  # of which real tokens
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verify_time: dict[int, tuple[int, float]] = field(default_factory=dict)  # AR -> (steps, seconds)

    def add_verify(self, *, ar: int, num_rows: int, num_tokens: int, seconds: float) -> None:
        """One verify step of AR rows per sequence (num_rows in all, num_tokens of them real)."""
        self.num_verify_steps += 1
        self.num_verify_rows += num_rows
        self.num_verify_tokens += num_tokens
        self.verify_seconds += seconds
        count, total = self.verify_time.get(ar, (0, 0.0))
        self.verify_time[ar] = (count + 1, total + seconds)

    def verify_cost_ratio(self, ar: int | None) -> float | None:
        """Measured time of an AR-row verify step over a decode step (None until both were seen)."""
        count, total = self.verify_time.get(ar, (0, 0.0))
        if not count or self.num_decode_steps < 2 or ar is None:
            return None
        return (total / count) / (self.decode_seconds / self.num_decode_steps)


class Engine:
    """Owns the sessions (created lazily, per rung) and one KV cache: one sequence, or `batch` of them.

    A batched engine decodes B sequences per call (batched graphs, one KV window per sequence); it has no
    prefill graphs of its own and starts from a prompt another engine prefilled (`load_prefix`).
    """

    def __init__(self, model_dir: str | Path, *, options: EngineOptions = EngineOptions(), batch: int = 1,
                 weights_from: Engine | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.manifest: Manifest = load_manifest(self.model_dir)
        self.options = options
        self.device = resolve_device(options.device.device, family=self.manifest, model_dir=self.model_dir)
        cfg = self.manifest.model
        self.config = cfg
        self.batch = batch
        self.quant = self.manifest.quant  # boundary quantization of a quantized family, else None
        self._decode = self.manifest.graphs_of(GraphKind.DECODE, batch=batch)
        multi = self.manifest.graphs_of(GraphKind.PREFILL, batch=batch)
        if not self._decode:
            raise ValueError(f"{self.model_dir} has no decode graph for batch {batch}: export it with "
                             f"--batch-sizes {batch}" if batch > 1 else f"{self.model_dir} has no decode graph")
        self.max_context = self._decode[-1].shape.context
        longest = max((g.shape.ar for g in multi), default=1)
        self._prefill = _with_rows(tuple(g for g in multi if g.shape.ar == longest), options.prefill_rows,
                                   config=cfg, kv_dtype=self.manifest.kv_dtype)  # prompt chunks
        self.prefill_len = max((g.shape.ar for g in self._prefill), default=1)
        # One graph takes any number of rows (a logits_index input): chunks run at their own length, and rows pair
        # (not while running layer-group parts: they exist for the exported shapes only)
        self._any_rows = (bool(self._prefill) and not options.run_parts
                          and any(s.role is Role.LOGITS_INDEX for s in self._prefill[0].inputs))
        self._rows_entries: dict[tuple[int, bool], GraphEntry] = {}
        # Every AR=N graph that scores all its rows can verify drafts (and score a text); by AR, each a ladder
        # sorted by past length. An in-place family's prompt graph scores its last row only.
        multi = tuple(g for g in multi if g.logit_rows == g.shape.ar)
        self.verify_lens = tuple(sorted({g.shape.ar for g in multi}))
        self._verify = {ar: tuple(g for g in multi if g.shape.ar == ar) for ar in self.verify_lens}
        if self._any_rows:  # the one graph verifies exactly the rows a step has: two, a token and one draft, too
            self.verify_lens = tuple(sorted({2, *self.verify_lens}))
        # A quantized family's first token runs alone in a graph with its own activation ranges
        self._sink = self.manifest.graphs_of(GraphKind.SINK, batch=batch)[:1]
        self.layout = LAYOUTS[self.manifest.kv_layout]
        self.kv_strategy = self.layout.kv_strategy(options.kv_strategy, model_dir=self.model_dir)  # the one in use
        self.kv = make_kv_cache(
            KVSpec(num_tensors=num_kv_tensors(cfg), head_dim=cfg.head_dim, dtype=self.manifest.kv_dtype,
                   max_past=self._decode[-1].shape.past_len, max_ar=max(self.prefill_len, 1),
                   max_positions=cfg.max_positions, reserve=options.kv_reserve, overflow=options.overflow,
                   batch=batch, pad_values=self.quant.kv_pad_values if self.quant else None,
                   heads_per_buffer=self.layout.heads_per_buffer(cfg)),
            self.kv_strategy, bmc_r=options.bmc_r, local=local_tensors(cfg), window=cfg.local_window)
        if weights_from is None:  # the engines made from this one share its weights and hold small caches
            check_memory(self.model_dir, weights_bytes=self.manifest.weights_bytes,
                         kv_bytes=self.kv.stats.reserved_bytes)
        rope = RopeTable(cfg)
        self.family = FamilyContext(config=cfg, rope=rope, quant=self.quant,
                                    local_rope=RopeTable(cfg, local=True) if cfg.local_layers else None)
        self._runners: dict[str, Runner] = {}
        if weights_from is not None:  # one session per graph file and one weight mapping per process, not per engine
            self.sessions = weights_from.sessions  # shared with the engines made from this one (batched rows, draft)
        else:
            cpu = self.device is Device.CPU
            self.sessions = GraphSessions(
                self.model_dir, device=self.device, options=options.device,
                shared_weights=(SharedWeights(self.model_dir / self.manifest.weights_file)
                                if cpu and options.share_weights else None),
                # A `--target cpu` family's sessions map one prepacked copy of its weights (prepacked.py)
                packed_dir=(store_dir(self.model_dir, self.manifest.weights_sha256)
                            if cpu and self.manifest.target == "cpu" else None))
        self._ladder_entries: dict[str, GraphEntry] = {}
        # A family whose graphs take any past length (the cpu target) decodes on BMC's ladder, r rows a rung.
        self._ladder_step = (ladder_step(max_context=self.max_context, override=options.bmc_r)
                             if self.manifest.dynamic_past and self.layout.climbs_ladder else None)
        self._token = np.zeros(1, np.int64)
        self.counters = StepCounters()
        if options.run_parts:  # part entries exist per exported graph, not per ladder rung
            self._ladder_step = None
        self.runahead = self.parallel_prefill(options.prefill_workers) if options.prefill_workers > 1 else None

    def parallel_prefill(self, workers: int) -> Runahead:
        """KV-Runahead's workers (runahead.py) on this engine's cache, prompt graphs, sessions and family."""
        return Runahead(kv=self.kv, prompt_graphs=self._prefill, manifest=self.manifest, sessions=self.sessions,
                        family=self.family, workers=workers)

    # -- graphs -------------------------------------------------------------------------
    def runner(self, entry: GraphEntry) -> Runner:
        if entry.name not in self._runners and self.options.run_parts:
            parts = part_entries(self.manifest, entry, model_dir=self.model_dir)
            self._runners[entry.name] = chain_runner(entry, parts, self._open_runner)
        return self._open_runner(entry)

    def _open_runner(self, entry: GraphEntry) -> Runner:
        if entry.name not in self._runners:
            session = self.sessions.shared(
                entry,
                # MatMulNBits without its prepacked weights dequantizes every weight on every step
                prepack=self.layout.prepacks or self._ladder_step is not None
                or (self.options.prepack and entry.shape.batch * entry.shape.ar > 1))
            self._runners[entry.name] = self.layout.runner(session, entry, family=self.family)
        return self._runners[entry.name]

    def warm_up(self, *, verify: bool = True) -> None:
        """Open and run the first rung's graphs once now, so no answer pays for loading or first-run setup; the
        verify graphs too when verify (speculation will run): each session holds its own prepacked weights, so a
        graph nobody runs is not opened."""
        if self.num_cached:
            return
        verify_graphs = (ladder[0] for ladder in self._verify.values()) if verify else ()
        for entry in (self._decode[0], *self._prefill[:1], *verify_graphs):
            self._run(entry, self._token)  # writes only slot rows past the (empty) valid region
            self.kv.advance(0)
        if self.runahead is not None:
            self.runahead.warm_up(token_id=int(self._token[0]))

    def load_all(self) -> None:
        for entry in (*self._sink, *self._decode, *self._prefill,
                      *(g for ladder in self._verify.values() for g in ladder)):
            self.runner(entry)

    def _rung(self, graphs: tuple[GraphEntry, ...], num_valid: int) -> GraphEntry:
        """The context ladder: the smallest past window that holds every valid row."""
        # Prompt chunks and verify steps climb it too: a smaller window is less attention work per row.
        if not self.layout.climbs_ladder:  # the graph attends over the cached rows only, whatever its window
            return graphs[-1]
        if self._ladder_step is not None and num_valid < graphs[-1].shape.past_len:
            return self._ladder_entry(graphs[-1], num_valid)
        for entry in graphs:
            if entry.shape.past_len >= num_valid:
                return entry
        return graphs[-1]  # the kv_manager's overflow policy decides (slide or ContextFull)

    def _ladder_entry(self, largest: GraphEntry, num_valid: int) -> GraphEntry:
        """A rung of a symbolic-past graph: past length a multiple of r (one runner per rung)."""
        p = rung_past_len(num_valid, step=self._ladder_step, max_past=largest.shape.past_len)
        name = f"{largest.name}@p{p}"
        if name not in self._ladder_entries:
            shape = dataclasses.replace(largest.shape, past_len=p)
            inputs, outputs = graph_io(self.config, shape)
            self._ladder_entries[name] = dataclasses.replace(largest, name=name, shape=shape, inputs=inputs,
                                                             outputs=outputs)
        return self._ladder_entries[name]

    # -- steps --------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Rows cached (the longest sequence's, in a batch)."""
        return int(self.kv.lengths.max())

    def _run(self, entry: GraphEntry, tokens: np.ndarray) -> np.ndarray:
        """Run AR rows (n <= AR real ones per sequence, the rest padding) without committing; logits [B, AR, V].

        tokens: [n] for one sequence or [B, n].
        """
        num_real = tokens.shape[-1]
        self.kv.prepare(past_len=entry.shape.past_len, ar=entry.shape.ar)
        runner = self.runner(entry)
        runner.input_ids[:, :num_real] = tokens
        # Padding rows repeat the last real token. Never id 0: SmolLM2's <|endoftext|> carries massive
        # activations wherever it is, and calibration must see what runs.
        runner.input_ids[:, num_real:] = runner.input_ids[:, num_real - 1:num_real]
        return runner.run(self.kv, num_real=num_real)

    def _step(self, entry: GraphEntry, tokens: np.ndarray) -> np.ndarray:
        """Run and commit every real row; the last real token's logits [V]."""
        logits = self._run(entry, tokens)
        self.kv.advance(len(tokens))
        return logits[0, len(tokens) - 1 if entry.logit_rows > 1 else 0]

    def verify_len(self, num_tokens: int) -> int | None:
        """The smallest exported AR that takes num_tokens rows at the current length (None: none fits); a graph
        that takes any number of rows verifies exactly num_tokens."""
        if self._any_rows:
            fits = 1 < num_tokens <= self.prefill_len and self.num_cached <= self._prefill[-1].shape.past_len
            return num_tokens if fits else None
        for ar in self.verify_lens:
            if ar >= num_tokens and self._verify[ar][-1].shape.past_len >= self.num_cached:
                return ar
        return None

    def verify(self, token_ids, *, num_real: np.ndarray | None = None) -> np.ndarray:
        """Score tokens in one AR=N call, committing nothing: logits [n, V] ([B, n, V] for token_ids
        [B, n]), row i predicts after token i.

        Their K/V land in the slot rows right after each window; `commit(m)` keeps the first m (per
        sequence: an array), and the rest are simply overwritten by the next step (no copy, no clearing).
        num_real: per sequence, how many of the n tokens are real (the rest pad a ragged batch; counters only).
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        n = ids.shape[-1]
        ar = self.verify_len(n)
        if ar is None:
            raise ValueError(f"no verify graph takes {n} tokens at {self.num_cached} cached")
        self.check_room(n)
        t0 = time.perf_counter()
        entry = self._rows_entry(ar, all_rows=True) if self._any_rows else self._rung(self._verify[ar], self.num_cached)
        logits = self._run(entry, ids)
        logits = logits[0, :n] if ids.ndim == 1 else logits[:, :n]
        self.counters.add_verify(ar=ar, num_rows=ar * self.batch, seconds=time.perf_counter() - t0,
                                 num_tokens=int(num_real.sum()) if num_real is not None else ids.size)
        return logits

    def verify_cost_ratio(self, ar: int | None) -> float | None:
        """Measured time of an AR-row verify step over a decode step (None until both were seen)."""
        return self.counters.verify_cost_ratio(ar)

    def commit(self, num_tokens: int | np.ndarray) -> None:
        """Keep the first num_tokens rows the last verify wrote (an array [B]: per sequence)."""
        self.kv.advance(num_tokens)

    def check_room(self, num_new: int) -> None:
        """Refuse, before anything runs, what the error policy could not finish."""
        if self.options.overflow is Overflow.ERROR and self.num_cached + num_new > self.max_context:
            raise ContextFull(f"context full: {self.num_cached} cached + {num_new} new tokens exceed the "
                              f"largest context {self.max_context}; use --on-overflow slide or export larger "
                              "--context sizes")

    @property
    def pairs_rows(self) -> bool:
        """Whether no row runs alone in a step. ORT's CPU kernels take another path for a step of one real row
        (MatMulNBits' one-row kernel, GroupQueryAttention's token path) than for two or more, and the two round
        differently: a greedy near-tie then flips with the path a row took (prompt cache, chunk size, batch,
        speculation). Any step of two or more real rows gives a row the same bits, so a lone row runs again beside
        the row before it (tests/test_greedy_paths.py): decode reads every weight once either way."""
        return self._any_rows and self.options.paired_rows

    def _rows_entry(self, rows: int, *, all_rows: bool = False) -> GraphEntry:
        """The prompt graph at exactly `rows` rows, scoring the last real row or every row (a family whose graph
        takes any number)."""
        if (rows, all_rows) not in self._rows_entries:
            self._rows_entries[rows, all_rows] = _with_rows(self._prefill[-1:], rows, config=self.config,
                                                            kv_dtype=self.manifest.kv_dtype, all_rows=all_rows)[0]
        return self._rows_entries[rows, all_rows]

    def _can_pair(self, previous: int | None) -> bool:
        return (previous is not None and self.pairs_rows and self.batch == 1 and self.num_cached > 0
                and self.can_truncate(self.num_cached - 1))

    def _paired(self, token_id: int, previous: int) -> np.ndarray:
        """token_id's logits [V], its row run beside previous (the last cached row, run again to the same bits)."""
        self.kv.truncate(self.num_cached - 1)
        return self._step(self._rows_entry(2), np.array([previous, token_id], np.int64))

    def prefill(self, token_ids, *, previous: int | None = None) -> np.ndarray:
        """Append tokens to the cache in prefill-graph chunks; returns the last token's logits [V].

        previous: the last cached token (when known), for a lone token to run beside (pairs_rows)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("nothing to prefill: the prompt is empty")
        self.check_room(ids.size)
        t0 = time.perf_counter()
        logits = None
        start = 0
        if ids.size == 1 and self._can_pair(previous):
            logits, start = self._paired(int(ids[0]), previous), 1
        if self._sink and self.num_cached == 0:
            logits, start = self._step(self._sink[0], ids[:1]), 1
        if self.runahead is not None and self.runahead.takes(ids.size - start):
            logits, start = self.runahead.prefill(ids[start:]), ids.size
        max_prefill_past = self._prefill[-1].shape.past_len if self._prefill else -1
        while start < ids.size:
            rest = ids.size - start
            # A lone token goes through a decode graph; so do the last few (< AR) tokens of a full context,
            # which the largest prefill window cannot hold without sliding.
            past_prefill = self.num_cached > max_prefill_past and self.options.overflow is Overflow.ERROR
            if rest == 1 or not self._prefill or past_prefill:
                logits = self._step(self._rung(self._decode, self.num_cached), ids[start:start + 1])
                start += 1
                continue
            entry = self._rung(self._prefill, self.num_cached)
            num_rows = min(rest, entry.shape.ar)
            if self._any_rows:  # a chunk runs at its own length, and never leaves one row for last (pairs_rows)
                num_rows -= self.pairs_rows and rest - num_rows == 1 and num_rows > 2
                entry = entry if num_rows == entry.shape.ar else self._rows_entry(num_rows)
            chunk = ids[start:start + num_rows]
            logits = self._step(entry, chunk)
            start += chunk.size
        self.counters.num_prefill_tokens += ids.size
        self.counters.prefill_seconds += time.perf_counter() - t0
        return logits

    def score(self, token_ids) -> np.ndarray:
        """Teacher forcing: append tokens like prefill, but return every row's logits [n, V] (evaluation)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        self.check_room(ids.size)
        out = np.empty((ids.size, self.config.vocab_size), np.float32)  # once per call, not per token
        scoring = self._verify[max(self._verify)] if self._verify else ()  # the longest exported all-rows AR
        start = 0
        if self._sink and self.num_cached == 0 and ids.size:
            out[0], start = self._step(self._sink[0], ids[:1]), 1
        while start < ids.size:
            fits = scoring and self.num_cached <= scoring[-1].shape.past_len
            graphs = scoring if fits and ids.size - start > 1 else self._decode
            entry = self._rung(graphs, self.num_cached)
            chunk = ids[start:start + entry.shape.ar]
            out[start:start + chunk.size] = self._run(entry, chunk)[0, :chunk.size]
            self.kv.advance(chunk.size)
            start += chunk.size
        return out

    def decode(self, token_id: int, *, previous: int | None = None) -> np.ndarray:
        """One token in, next-token logits [V] out; previous: the last cached token, to run beside (pairs_rows)."""
        self.check_room(1)
        t0 = time.perf_counter()
        if self._can_pair(previous):
            logits = self._paired(token_id, previous)
        else:
            self._token[0] = token_id
            first = self._sink and self.num_cached == 0
            logits = self._step(self._sink[0] if first else self._rung(self._decode, self.num_cached), self._token)
        self.counters.num_decode_steps += 1
        self.counters.decode_seconds += time.perf_counter() - t0
        return logits

    # -- batches ------------------------------------------------------------------------
    def load_prefix(self, source: Engine) -> None:
        """Start every sequence from source's cached rows: one copy per request, never per token."""
        self.reset()
        rows = source.kv.valid_block(0)  # [T, n, D] view
        for seq in range(self.batch):
            self.kv.load(seq, rows)

    def load_row(self, seq: int, source: Engine, *, source_seq: int = 0, num_rows: int | None = None) -> None:
        """Make sequence seq start from the first num_rows (default: all) cached rows of source's sequence
        source_seq, the other sequences untouched: one copy per request, never per token (continuous batching)."""
        rows = source.kv.valid_block(source_seq)  # [T, n, D]
        self.load_rows(seq, rows if num_rows is None else rows[:, :num_rows])

    def load_rows(self, seq: int, rows: np.ndarray) -> None:
        """Make sequence seq start from these cached rows [T, n, D] (another cache's, or saved ones: slots.py)."""
        self.kv.clear(seq)
        self.kv.load(seq, rows)

    def decode_batch(self, token_ids: np.ndarray, *, active: np.ndarray,
                     previous: np.ndarray | None = None) -> np.ndarray:
        """One token per sequence in, logits [B, V] out; finished (inactive) sequences commit nothing.

        previous [B]: each sequence's last cached token, which its row runs beside (pairs_rows)."""
        self.check_room(1)
        t0 = time.perf_counter()
        rows = np.flatnonzero(active)
        if previous is not None and self.pairs_rows and all(
                self.kv.lengths[b] > 0 and self.kv.can_truncate(int(self.kv.lengths[b]) - 1, b) for b in rows):
            for b in rows.tolist():  # each active row steps back one row, to run it again beside its new token
                self.kv.truncate(int(self.kv.lengths[b]) - 1, b)
            tokens = np.stack([previous, token_ids], axis=1).astype(np.int64)  # [B, 2]
            logits = self._run(self._rows_entry(2), tokens)
            self.kv.advance(2 * active.astype(np.int64))
        else:
            logits = self._run(self._rung(self._decode, int(self.kv.lengths.max())),
                               token_ids.reshape(self.batch, 1))
            self.kv.advance(active.astype(np.int64))
        self.counters.num_decode_steps += 1
        self.counters.decode_seconds += time.perf_counter() - t0
        return logits[:, 0]

    def truncate(self, num_tokens: int) -> None:
        """Rewind the cache to its first num_tokens rows (no re-prefill of what stays)."""
        self.kv.truncate(num_tokens)

    def can_truncate(self, num_tokens: int) -> bool:
        """Whether truncate(num_tokens) can keep every row the next step reads (local layers keep their newest rows
        only: a rewind past them needs a prefill from the start)."""
        return 0 <= num_tokens <= self.num_cached and self.kv.can_truncate(num_tokens)

    def reset(self) -> None:
        self.kv.reset()

    @property
    def kv_bytes(self) -> int:
        """KV bytes the cache reserves (a batched engine: a copy of the prompt in every row)."""
        return self.kv.stats.reserved_bytes

    @property
    def device_name(self) -> str:
        return self.device.value
