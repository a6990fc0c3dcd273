"""Which graph runs a step: an Engine's graphs by kind, the context ladder's rung, and a graph that takes any number
of rows at the rows a step has. Entries only: the Engine opens their runners."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from staticlm.runtime.engine.ladder import ladder_step, rung_past_len
from staticlm.runtime.engine.layout import LayoutRules
from staticlm.runtime.family.contract import Role, graph_io, in_place_graph_io
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest


def with_rows(chunks: tuple[GraphEntry, ...], rows: int | None, *, config, kv_dtype: str,
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


def token_graphs(multi: tuple[GraphEntry, ...]) -> tuple[GraphEntry, ...]:
    """The ladder of the fewest-row graphs that score every row: where a family has no decode graph (an NPU plan's
    token graph, export/htp/plan.py), a decode step runs there, its one real row followed by padding rows."""
    scoring = [g for g in multi if g.logit_rows == g.shape.ar]
    if not scoring:
        return ()
    ar = min(g.shape.ar for g in scoring)
    return tuple(sorted((g for g in scoring if g.shape.ar == ar), key=lambda g: g.shape.past_len))


class EngineGraphs:
    """The graphs an Engine of `batch` rows runs: decode (a ladder by past length), prompt chunks, verify ladders
    by AR, the sink. prefill_rows, run_parts, bmc_r: the EngineOptions of the same names."""

    def __init__(self, manifest: Manifest, *, model_dir: Path, batch: int, layout: LayoutRules,
                 prefill_rows: int | None = None, run_parts: bool = False, bmc_r: int | None = None) -> None:
        self.config, self.kv_dtype, self.layout = manifest.model, manifest.kv_dtype, layout
        self.decode = manifest.graphs_of(GraphKind.DECODE, batch=batch)
        multi = manifest.graphs_of(GraphKind.PREFILL, batch=batch)
        if not self.decode:  # a device plan's token graph verifies k rows and decodes through them (padding rows)
            self.decode = token_graphs(multi)
        if not self.decode:
            raise ValueError(f"{model_dir} has no decode graph for batch {batch}: export it with "
                             f"--batch-sizes {batch}" if batch > 1 else f"{model_dir} has no decode graph")
        self.max_context = self.decode[-1].shape.context
        longest = max((g.shape.ar for g in multi), default=1)
        self.prefill = with_rows(tuple(g for g in multi if g.shape.ar == longest), prefill_rows,
                                 config=self.config, kv_dtype=self.kv_dtype)  # prompt chunks
        self.prefill_len = max((g.shape.ar for g in self.prefill), default=1)
        # One graph takes any number of rows (a logits_index input): chunks run at their own length, and rows pair
        # (not while running layer-group parts: they exist for the exported shapes only)
        self.any_rows = (bool(self.prefill) and not run_parts
                         and any(s.role is Role.LOGITS_INDEX for s in self.prefill[0].inputs))
        self._rows_entries: dict[tuple[int, bool], GraphEntry] = {}
        # Every AR=N graph that scores all its rows can verify drafts (and score a text); by AR, each a ladder
        # sorted by past length. An in-place family's prompt graph scores its last row only.
        multi = tuple(g for g in multi if g.logit_rows == g.shape.ar)
        self.verify_lens = tuple(sorted({g.shape.ar for g in multi}))
        self.verify = {ar: tuple(g for g in multi if g.shape.ar == ar) for ar in self.verify_lens}
        if self.any_rows:  # the one graph verifies exactly the rows a step has: two, a token and one draft, too
            self.verify_lens = tuple(sorted({2, *self.verify_lens}))
        # A quantized family's first token runs alone in a graph with its own activation ranges
        self.sink = manifest.graphs_of(GraphKind.SINK, batch=batch)[:1]
        self._ladder_entries: dict[str, GraphEntry] = {}
        # A family whose graphs take any past length (the cpu target) decodes on BMC's ladder, r rows a rung; not
        # while running parts: part entries exist per exported graph, not per ladder rung.
        self.ladder_step = (ladder_step(max_context=self.max_context, override=bmc_r)
                            if manifest.dynamic_past and layout.climbs_ladder and not run_parts else None)

    def all(self) -> tuple[GraphEntry, ...]:
        """Every exported graph this engine may run."""
        return (*self.sink, *self.decode, *self.prefill, *(g for ladder in self.verify.values() for g in ladder))

    def rung(self, graphs: tuple[GraphEntry, ...], num_valid: int) -> GraphEntry:
        """The context ladder: the smallest past window that holds every valid row."""
        # Prompt chunks and verify steps climb it too: a smaller window is less attention work per row.
        if not self.layout.climbs_ladder:  # the graph attends over the cached rows only, whatever its window
            return graphs[-1]
        if self.ladder_step is not None and num_valid < graphs[-1].shape.past_len:
            return self._ladder_entry(graphs[-1], num_valid)
        for entry in graphs:
            if entry.shape.past_len >= num_valid:
                return entry
        return graphs[-1]  # the kv_manager's overflow policy decides (slide or ContextFull)

    def _ladder_entry(self, largest: GraphEntry, num_valid: int) -> GraphEntry:
        """A rung of a symbolic-past graph: past length a multiple of r (one runner per rung)."""
        p = rung_past_len(num_valid, step=self.ladder_step, max_past=largest.shape.past_len)
        name = f"{largest.name}@p{p}"
        if name not in self._ladder_entries:
            shape = dataclasses.replace(largest.shape, past_len=p)
            inputs, outputs = graph_io(self.config, shape)
            self._ladder_entries[name] = dataclasses.replace(largest, name=name, shape=shape, inputs=inputs,
                                                             outputs=outputs)
        return self._ladder_entries[name]

    def rows_entry(self, rows: int, *, all_rows: bool = False) -> GraphEntry:
        """The prompt graph at exactly `rows` rows, scoring the last real row or every row (a family whose graph
        takes any number)."""
        if (rows, all_rows) not in self._rows_entries:
            self._rows_entries[rows, all_rows] = with_rows(self.prefill[-1:], rows, config=self.config,
                                                           kv_dtype=self.kv_dtype, all_rows=all_rows)[0]
        return self._rows_entries[rows, all_rows]

    def chunk(self, num_left: int, *, num_cached: int, paired: bool, slides: bool) -> tuple[GraphEntry, int]:
        """The graph of a prompt's next chunk after num_cached rows, num_left tokens to go, and how many tokens it
        takes. paired: never leave one row for last (Engine.pairs_rows); slides: the overflow policy slides."""
        # A lone token goes through a decode graph; so do the last few (< AR) tokens of a full context, which the
        # largest prefill window cannot hold without sliding.
        past_prefill = not slides and num_cached > (self.prefill[-1].shape.past_len if self.prefill else -1)
        if num_left == 1 or not self.prefill or past_prefill:
            return self.rung(self.decode, num_cached), 1
        entry = self.rung(self.prefill, num_cached)
        num_rows = min(num_left, entry.shape.ar)
        if self.any_rows:  # a chunk runs at its own length, and never leaves one row for last
            num_rows -= paired and num_left - num_rows == 1 and num_rows > 2
            entry = entry if num_rows == entry.shape.ar else self.rows_entry(num_rows)
        return entry, num_rows

    def verify_len(self, num_tokens: int, *, num_cached: int) -> int | None:
        """The smallest exported AR that takes num_tokens rows after num_cached (None: none fits); a graph that
        takes any number of rows verifies exactly num_tokens."""
        if self.any_rows:
            fits = 1 < num_tokens <= self.prefill_len and num_cached <= self.prefill[-1].shape.past_len
            return num_tokens if fits else None
        for ar in self.verify_lens:
            if ar >= num_tokens and self.verify[ar][-1].shape.past_len >= num_cached:
                return ar
        return None

    def verify_entry(self, ar: int, *, num_cached: int) -> GraphEntry:
        """The graph that scores every one of AR rows after num_cached."""
        return self.rows_entry(ar, all_rows=True) if self.any_rows else self.rung(self.verify[ar], num_cached)

    def scoring(self, num_tokens: int, *, num_cached: int) -> GraphEntry:
        """The graph teacher forcing runs next: the longest exported all-rows AR while it holds the cache and more
        than one token is left, else a decode step."""
        scoring = self.verify[max(self.verify)] if self.verify else ()
        fits = scoring and num_cached <= scoring[-1].shape.past_len
        return self.rung(scoring if fits and num_tokens > 1 else self.decode, num_cached)
