"""The model runner: prefill and decode over a graph family, KV in the kv_manager's buffers."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from staticlm.kv_manager import ContextFull, KVSpec, Overflow, make_kv_cache
from staticlm.runtime import kernels
from staticlm.runtime.engine import steps
from staticlm.runtime.engine.engine_options import EngineOptions
from staticlm.runtime.engine.graphs import EngineGraphs
from staticlm.runtime.engine.layout import LAYOUTS
from staticlm.runtime.engine.parts import chain_runner, part_entries
from staticlm.runtime.engine.rope import RopeTable
from staticlm.runtime.engine.runahead import Runahead
from staticlm.runtime.engine.runner import FamilyContext, Runner
from staticlm.runtime.engine.steps import StepCounters
from staticlm.runtime.family.contract import local_tensors, num_kv_tensors
from staticlm.runtime.family.manifest import GraphEntry, Manifest, load_manifest
from staticlm.runtime.family.weights import SharedWeights
from staticlm.runtime.session.device import Device, resolve_device
from staticlm.runtime.session.memory import check_memory
from staticlm.runtime.session.prepacked import store_dir
from staticlm.runtime.session.sessions import GraphSessions


class Engine:
    """Owns the sessions (created lazily, per rung) and one KV cache: one sequence, or `batch` of them.

    A batched engine decodes B sequences per call (batched graphs, one KV window per sequence); it has no
    prefill graphs of its own and starts from a prompt another engine prefilled (`load_prefix`). Which graph runs
    a step is graphs.py's; this class runs it and commits its rows.
    """

    def __init__(self, model_dir: str | Path, *, options: EngineOptions | None = None, batch: int = 1,
                 weights_from: Engine | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.manifest: Manifest = load_manifest(self.model_dir)
        self.options = options = options or EngineOptions()
        self.device = resolve_device(options.device.device, family=self.manifest, model_dir=self.model_dir)
        if self.device is Device.HTP and self.manifest.parts is not None and self.manifest.parts.device_sized:
            options = self.options = dataclasses.replace(options, run_parts=True)  # its whole graphs never compile
        cfg = self.manifest.model
        self.config = cfg
        self.batch = batch
        self.quant = self.manifest.quant  # boundary quantization of a quantized family, else None
        self.layout = LAYOUTS[self.manifest.kv_layout]
        self.graphs = EngineGraphs(self.manifest, model_dir=self.model_dir, batch=batch, layout=self.layout,
                                   prefill_rows=options.prefill_rows, run_parts=options.run_parts,
                                   bmc_r=options.bmc_r)
        self.max_context, self.prefill_len = self.graphs.max_context, self.graphs.prefill_len
        self.verify_lens = self.graphs.verify_lens
        self.kv_strategy = self.layout.kv_strategy(options.kv_strategy, model_dir=self.model_dir)  # the one in use
        self.kv = make_kv_cache(
            KVSpec(num_tensors=num_kv_tensors(cfg), head_dim=cfg.head_dim, dtype=self.manifest.kv_dtype,
                   max_past=self.graphs.decode[-1].shape.past_len, max_ar=max(self.prefill_len, 1),
                   max_positions=cfg.max_positions, reserve=options.kv_reserve, overflow=options.overflow,
                   batch=batch, pad_values=self.quant.kv_pad_values if self.quant else None,
                   heads_per_buffer=self.layout.heads_per_buffer(cfg)),
            self.kv_strategy, bmc_r=options.bmc_r, local=local_tensors(cfg), window=cfg.local_window)
        if weights_from is None:  # the engines made from this one share its weights and hold small caches
            check_memory(self.model_dir, weights_bytes=self.manifest.weights_bytes,
                         kv_bytes=self.kv.stats.reserved_bytes)
            kernels.check_family(self.manifest.custom_ops)
        self.family = FamilyContext(config=cfg, rope=RopeTable(cfg), quant=self.quant,
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
        self._token = np.zeros(1, np.int64)  # [1] a decode step's input
        self._pair_tokens = np.zeros((batch, 2), np.int64)  # [B, 2] a paired decode step's rows: previous, new
        self._row_steps = np.zeros(batch, np.int64)  # [B] rows each sequence commits this step
        self.counters = StepCounters()
        self.runahead = self.parallel_prefill(options.prefill_workers) if options.prefill_workers > 1 else None

    def parallel_prefill(self, workers: int) -> Runahead:
        """KV-Runahead's workers (runahead.py) on this engine's cache, prompt graphs, sessions and family."""
        return Runahead(kv=self.kv, prompt_graphs=self.graphs.prefill, manifest=self.manifest,
                        sessions=self.sessions, family=self.family, workers=workers)

    # -- runners --------------------------------------------------------------------------
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
                prepack=self.layout.prepacks or self.graphs.ladder_step is not None
                or (self.options.prepack and entry.shape.batch * entry.shape.ar > 1))
            self._runners[entry.name] = self.layout.runner(session, entry, family=self.family)
        return self._runners[entry.name]

    def warm_up(self, *, verify: bool = True) -> None:
        """Open and run the first rung's graphs once now, so no answer pays for loading or first-run setup; the
        verify graphs too when verify (speculation will run): each session holds its own prepacked weights, so a
        graph nobody runs is not opened."""
        if self.num_cached:
            return
        verify_graphs = (ladder[0] for ladder in self.graphs.verify.values()) if verify else ()
        for entry in (self.graphs.decode[0], *self.graphs.prefill[:1], *verify_graphs):
            self._run(entry, self._token)  # writes only slot rows past the (empty) valid region
            self.kv.advance(0)
        if self.runahead is not None:
            self.runahead.warm_up(token_id=int(self._token[0]))

    def load_all(self) -> None:
        for entry in self.graphs.all():
            self.runner(entry)

    # -- steps --------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Rows cached (the longest sequence's, in a batch)."""
        return int(self.kv.lengths.max())

    def _run(self, entry: GraphEntry, tokens: np.ndarray, *, active: np.ndarray | None = None) -> np.ndarray:
        """Run AR rows (n <= AR real ones per sequence, the rest padding) without committing; logits [B, AR, V].

        tokens: [n] for one sequence or [B, n]; active [B]: the rows whose attention runs (Runner.run), None: all.
        """
        num_real = tokens.shape[-1]
        self.kv.prepare(past_len=entry.shape.past_len, ar=entry.shape.ar)
        runner = self.runner(entry)
        runner.input_ids[:, :num_real] = tokens
        # Padding rows repeat the last real token. Never id 0: SmolLM2's <|endoftext|> carries massive
        # activations wherever it is, and calibration must see what runs.
        runner.input_ids[:, num_real:] = runner.input_ids[:, num_real - 1:num_real]
        return runner.run(self.kv, num_real=num_real, active=active)

    def _step(self, entry: GraphEntry, tokens: np.ndarray) -> np.ndarray:
        """Run and commit every real row; the last real token's logits [V]."""
        logits = self._run(entry, tokens)
        self.kv.advance(len(tokens))
        return logits[0, len(tokens) - 1 if entry.logit_rows > 1 else 0]

    def verify_len(self, num_tokens: int) -> int | None:
        """The smallest verify step that takes num_tokens rows at the current length (None: none fits)."""
        return self.graphs.verify_len(num_tokens, num_cached=self.num_cached)

    def verify(self, token_ids, *, num_real: np.ndarray | None = None) -> np.ndarray:
        """Score tokens in one AR=N call, committing nothing (steps.verify): logits [n, V] ([B, n, V] for
        token_ids [B, n]).

        Their K/V land in the slot rows right after each window; `commit(m)` keeps the first m (per
        sequence: an array), and the rest are simply overwritten by the next step (no copy, no clearing).
        """
        return steps.verify(self, token_ids, num_real=num_real, run=lambda ar, ids: self._run(
            self.graphs.verify_entry(ar, num_cached=self.num_cached), ids))

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
        the row before it (tests/test_greedy_paths.py). That row is not free: MatMulNBits computes on int8
        activations, so its time grows with the rows of a step, and a paired batch step costs more than a plain one
        (the loop pairs a batch step only for greedy rows, rows.py). A family whose ops all compute each row alone
        (Manifest.rows_alone: staticlm's attention and GGUF kernels) gives a lone row those bits already."""
        return self.graphs.any_rows and self.options.paired_rows and not self.manifest.rows_alone

    def _can_pair(self, previous: int | None) -> bool:
        return (previous is not None and self.pairs_rows and self.batch == 1 and self.num_cached > 0
                and self.can_truncate(self.num_cached - 1))

    def _paired(self, token_id: int, previous: int) -> np.ndarray:
        """token_id's logits [V], its row run beside previous (the last cached row, run again to the same bits)."""
        self.kv.rewind(1)
        self._pair_tokens[0] = previous, token_id
        return self._step(self.graphs.rows_entry(2), self._pair_tokens[0])

    def prefill(self, token_ids, *, previous: int | None = None) -> np.ndarray:
        """Append tokens to the cache in prefill-graph chunks; returns the last token's logits [V].

        previous: the last cached token (when known), for a lone token to run beside (pairs_rows)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("nothing to prefill: the prompt is empty")
        self.check_room(ids.size)
        t0 = time.perf_counter()
        graphs, logits, start = self.graphs, None, 0
        if ids.size == 1 and self._can_pair(previous):
            logits, start = self._paired(int(ids[0]), previous), 1
        if graphs.sink and self.num_cached == 0:
            logits, start = self._step(graphs.sink[0], ids[:1]), 1
        if self.runahead is not None and self.runahead.takes(ids.size - start):
            logits, start = self.runahead.prefill(ids[start:]), ids.size
        while start < ids.size:
            entry, num_rows = graphs.chunk(ids.size - start, num_cached=self.num_cached, paired=self.pairs_rows,
                                           slides=self.options.overflow is not Overflow.ERROR)
            logits = self._step(entry, ids[start:start + num_rows])
            start += num_rows
        self.counters.num_prefill_tokens += ids.size
        self.counters.prefill_seconds += time.perf_counter() - t0
        return logits

    def score(self, token_ids) -> np.ndarray:
        """Teacher forcing: append tokens like prefill, but return every row's logits [n, V] (evaluation)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        self.check_room(ids.size)
        out = np.empty((ids.size, self.config.vocab_size), np.float32)  # once per call, not per token
        start = 0
        if self.graphs.sink and self.num_cached == 0 and ids.size:
            out[0], start = self._step(self.graphs.sink[0], ids[:1]), 1
        while start < ids.size:
            entry = self.graphs.scoring(ids.size - start, num_cached=self.num_cached)
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
            self.counters.num_paired_steps += 1
        else:
            self._token[0] = token_id
            first = self.graphs.sink and self.num_cached == 0
            entry = self.graphs.sink[0] if first else self.graphs.rung(self.graphs.decode, self.num_cached)
            logits = self._step(entry, self._token)
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

        previous [B]: each sequence's last cached token, which its row runs beside (pairs_rows): every active row
        steps back one row (one rewind for all of them) and runs it again in a two-row step. None: one row each."""
        self.check_room(1)
        t0 = time.perf_counter()
        steps_back = self._row_steps  # [B] 1 for an active row
        np.copyto(steps_back, active)
        # An idle row may hold a cached prefix (the prompt cache's): staticlm's attention skips it, where every
        # other attention reads all its rows; the linears run every row either way
        attending = active if self.manifest.exact_attention else None
        if previous is not None and self.pairs_rows and self.kv.can_rewind(steps_back):
            self.kv.rewind(steps_back)
            self._pair_tokens[:, 0], self._pair_tokens[:, 1] = previous, token_ids  # [B, 2]
            logits = self._run(self.graphs.rows_entry(2), self._pair_tokens, active=attending)
            steps_back *= 2
            self.kv.advance(steps_back)
            self.counters.num_paired_steps += 1
        else:
            logits = self._run(self.graphs.rung(self.graphs.decode, self.num_cached),
                               token_ids.reshape(self.batch, 1), active=attending)
            self.kv.advance(steps_back)
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


__all__ = ["Engine", "EngineOptions", "StepCounters"]
