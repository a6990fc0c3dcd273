"""KV-Runahead: a long prompt prefilled by several workers into the one KV cache.

The prompt is split into contiguous chunks, one per worker (partition.py). Worker i runs every layer group
(the family's parts, export/parts.py) over its chunk, in prompt-graph sub-chunks of AR rows. Before running group
g it waits until workers 0..i-1 have written their rows of group g's layers; then its GroupQueryAttention reads
those rows straight from the kv_manager's buffers and appends its own rows there (the in-place layout: past and
present are the same buffer, each worker writing only its own rows). Nothing is copied between workers; the one
sync is a per-group count of rows ready (RowSync), a one-way chain per layer group: worker i never waits on a later
worker.

Workers are threads, each with its own ONNX Runtime sessions and intra-op thread count: ORT releases the GIL
while a graph runs, so threads run in parallel without the shared memory a process pool would need for the KV
buffers (the bench compares both ways of spending the cores: `staticlm bench --only runahead`).
"""
from __future__ import annotations

import threading

import numpy as np

from staticlm.errors import UserError
from staticlm.kv_manager import KVCache
from staticlm.runtime.engine.in_place_runner import InPlaceRunner
from staticlm.runtime.engine.partition import PartitionTable, even_sizes, sizes_from_fractions
from staticlm.runtime.engine.parts import part_entries
from staticlm.runtime.engine.runner import FamilyContext
from staticlm.runtime.family.contract import KVLayout, Role
from staticlm.runtime.family.manifest import GraphEntry, Manifest
from staticlm.runtime.session.device import physical_cores
from staticlm.runtime.session.sessions import GraphSessions


class RowSync:
    """Per layer group, how many rows (from row 0) every layer of the group holds; workers wait on it.

    reading/wrote are instrumentation hooks (no-ops here; tests record them)."""

    def __init__(self, num_groups: int, *, base: int) -> None:
        self._ready = [base] * num_groups  # rows [0, ready[g]) of group g are written
        self._cond = threading.Condition()
        self._failed = False

    def wait(self, group: int, rows: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._ready[group] >= rows or self._failed)
            if self._failed:
                raise RuntimeError("another prefill worker failed")

    def publish(self, group: int, *, start: int, end: int) -> None:
        """Rows [start, end) of the group are written; workers publish in prompt order."""
        with self._cond:
            if self._ready[group] != start:
                raise RuntimeError(f"group {group}: rows from {start} published with {self._ready[group]} ready")
            self._ready[group] = end
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def reading(self, worker: int, group: int, *, rows: int) -> None:
        """worker's next run of group reads rows [0, rows) (and writes the rows after them)."""

    def wrote(self, worker: int, group: int, *, start: int, end: int) -> None:
        """worker's last run of group wrote rows [start, end)."""


class Runahead:
    """The engine's parallel prefill: `--prefill-workers N` on an in-place family exported with --parts.

    kv: the one-sequence cache the workers write into; prompt_graphs: the family's prompt-chunk graphs (the last one
    runs); sessions: where each worker opens its own sessions of the graph's parts; family: what their runners share.
    """

    def __init__(self, *, kv: KVCache, prompt_graphs: tuple[GraphEntry, ...], manifest: Manifest,
                 sessions: GraphSessions, family: FamilyContext, workers: int) -> None:
        model_dir = sessions.model_dir
        if manifest.kv_layout is not KVLayout.IN_PLACE or kv.spec.batch != 1:
            raise UserError(f"--prefill-workers needs an in-place family (the cpu target's default); "
                            f"{model_dir} keeps per-head windows")
        if getattr(family.config, "local_layers", None):  # their own row counts and windows: not written here
            raise UserError(f"--prefill-workers does not run models with sliding-window layers ({model_dir})")
        if not prompt_graphs:
            raise UserError(f"--prefill-workers needs prompt-chunk graphs; {model_dir} has none")
        self.kv, self.sessions, self.family, self.num_workers = kv, sessions, family, workers
        self.entry = prompt_graphs[-1]  # the prompt-chunk graph (in place: one file for every context)
        self.parts = part_entries(manifest, self.entry, model_dir=model_dir)
        total = sessions.options.num_threads or physical_cores()
        self.threads_per_worker = max(1, total // workers)
        self.table = PartitionTable.load()
        self._runners: list[list[InPlaceRunner]] | None = None  # [worker][group], opened on first use
        self._logits = np.zeros(family.config.vocab_size, np.float32)  # [V]
        self.num_tokens = 0  # prompt tokens the workers prefilled

    @property
    def ar(self) -> int:
        return self.entry.shape.ar

    def takes(self, num_tokens: int) -> bool:
        """Long enough for every worker to have a whole chunk, and no slide needed on the way."""
        kv = self.kv
        return num_tokens >= self.num_workers * self.ar and int(kv.lengths[0]) + num_tokens <= kv.spec.max_past

    def sizes(self, num_tokens: int) -> list[int]:
        """The searched partition interpolated from the host's table, else an even split."""
        fractions = self.table.fractions(self.num_workers, num_tokens)
        if fractions is None:
            return even_sizes(num_tokens, self.num_workers, align=self.ar)
        return sizes_from_fractions(num_tokens, fractions, align=self.ar)

    def warm_up(self, *, token_id: int = 0) -> None:
        """Open every worker's sessions and run each once (on token_id) on an empty cache, then forget the rows."""
        if int(self.kv.lengths[0]) == 0:
            self.prefill(np.full(self.num_workers * self.ar, token_id, np.int64))
            self.kv.truncate(0)
            self.num_tokens = 0

    def _open(self) -> list[list[InPlaceRunner]]:
        """Each worker's own sessions (its own intra-op threads), one per part."""
        if self._runners is None:
            self._runners = [[InPlaceRunner(self.sessions.new(p, prepack=True, num_threads=self.threads_per_worker),
                                            p, family=self.family) for p in self.parts]
                             for _ in range(self.num_workers)]
        return self._runners

    def prefill(self, token_ids, *, sizes: list[int] | None = None, sync_class: type[RowSync] = RowSync
                ) -> np.ndarray:
        """Append token_ids to the cache with the workers; the last token's logits [V] (an array the next call
        overwrites). sizes: each worker's chunk (default: self.sizes)."""
        ids = np.asarray(token_ids, np.int64)
        sizes = list(sizes or self.sizes(ids.size))
        if sum(sizes) != ids.size or len(sizes) != self.num_workers or min(sizes) < 1:
            raise ValueError(f"chunk sizes {sizes} do not split {ids.size} tokens over {self.num_workers} workers")
        kv = self.kv
        kv.prepare(past_len=kv.spec.max_past, ar=self.ar)  # a pending slide's compaction happens now, not mid-run
        base, position = int(kv.lengths[0]), int(kv.positions[0])
        runners = self._open()
        sync = sync_class(len(self.parts), base=base)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        errors: list[BaseException] = []

        def work(w: int) -> None:
            try:
                self._work(w, ids, start=starts[w], size=sizes[w], base=base, position=position, sync=sync,
                           runners=runners[w])
            except BaseException as e:  # noqa: BLE001 -- re-raised by the caller's thread after the join
                errors.append(e)
                sync.fail()

        threads = [threading.Thread(target=work, args=(w,), name=f"prefill-worker-{w}")
                   for w in range(self.num_workers - 1)]
        for t in threads:
            t.start()
        work(self.num_workers - 1)  # the last chunk's worker is this thread
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for start in range(0, ids.size, self.ar):  # commit: the rows are already in place
            kv.prepare(past_len=kv.spec.max_past, ar=self.ar)
            kv.advance(min(self.ar, ids.size - start))
        self.num_tokens += ids.size
        return self._logits

    def _hidden_banks(self, num_subs: int) -> list[dict[str, np.ndarray]]:
        """Per sub-chunk of one worker, the residual stream at each cut (name -> [B, AR, hidden]): two banks, since
        a worker runs group by group and the cut before the previous one is dead by then (cut k uses bank k mod 2).
        Once per call."""
        cuts = [[s.name for s in e.outputs if s.role is Role.HIDDEN] for e in self.parts]
        shape = next(s.shape for e in self.parts for s in e.outputs if s.role is Role.HIDDEN)  # [B, AR, hidden]
        banks = np.empty((2, max(map(len, cuts)), num_subs, *shape), np.float32)
        return [{name: banks[k % 2, i, sub] for k, names in enumerate(cuts) for i, name in enumerate(names)}
                for sub in range(num_subs)]

    def _work(self, w: int, ids: np.ndarray, *, start: int, size: int, base: int, position: int, sync: RowSync,
              runners: list[InPlaceRunner]) -> None:
        kv, ar = self.kv, self.ar
        subs = [(start + k, min(ar, size - k)) for k in range(0, size, ar)]  # (first prompt row, real rows)
        hidden = self._hidden_banks(len(subs))  # [sub-chunk] name -> [B, AR, hidden]
        lengths, positions = np.zeros(1, np.int64), np.zeros(1, np.int64)
        for g, runner in enumerate(runners):
            sync.wait(g, base + start)
            for k, (row, n) in enumerate(subs):
                if g == 0:
                    runner.input_ids[0, :n] = ids[row:row + n]
                    runner.input_ids[0, n:] = ids[row + n - 1]  # padding repeats the last real token (engine.py)
                runner.bind_hidden(hidden[k])
                lengths[0], positions[0] = base + row, position + row
                sync.reading(w, g, rows=base + row)
                logits = runner.run_rows(kv, lengths=lengths, positions=positions, num_real=n)
                sync.wrote(w, g, start=base + row, end=base + row + n)
            sync.publish(g, start=base + start, end=base + start + size)
        if w == self.num_workers - 1:
            row = subs[-1][1] - 1 if logits.shape[1] > 1 else 0
            self._logits[:] = logits[0, row]
