"""Calibration traces recorded one layer group at a time: the float model is never in memory whole (issue 34).

record_traces (traces.py) runs the float family through the Engine, and every decode step there needs the whole
model. Here the same sequences are computed group by group (groups.py): every sequence's rows through the first
group (its layers' KV rows kept, [T, rows, D] a sequence, and its residual rows handed on), then through the next;
the last group's logits choose the greedy tokens. The prompts are answered in lockstep: one token each per sweep over
the groups, so a sweep loads each group once for all of them.

Where it differs from record_traces, and why:
- The long conversation's answers are each prompt's answer alone (its short chat's greedy tokens), not the greedy
  tokens in the conversation's context: those would take one sweep over the groups per token, one after another
  (about a thousand sweeps for a 2K context).
- A lone decode row runs alone here, where the Engine pairs it with the row before it (Engine.pairs_rows), and the
  first token of a prompt in a prefill graph: the same arithmetic, rounded differently in the last bits.
The steps kept (strides, windows, sink steps, replay steps) and the KV and logits ranges follow record_traces's
rules: ranges over every row written and over each run's last row's logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from staticlm.kv_manager.mask import MASK_VALUE
from staticlm.runtime.family.contract import KV_OUTPUT_ROLES, kv_tensor_index
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, Manifest

from .activations import cpu_session
from .groups import MAX_GROUP_BYTES, release_memory, split_template
from .traces import StepFeeds, Traces, TraceStep, window_rows


@dataclass
class _Sequence:
    tokens: list[int]
    kv: np.ndarray  # [T, capacity, D]: the rows computed so far, every layer
    num_rows: int = 0
    run_ends: set[int] = field(default_factory=set)  # rows that end a run: their logits count in the range
    logits: np.ndarray | None = None  # the last computed row's logits [V]
    answer: list[int] = field(default_factory=list)


class _GroupedGraph:
    """One float family graph cut into layer groups (when first run)."""

    def __init__(self, float_dir: Path, entry: GraphEntry, *, config, max_bytes: int) -> None:
        self.float_dir, self.entry, self.config, self.max_bytes = float_dir, entry, config, max_bytes
        self.feeds = StepFeeds(entry.inputs, entry.shape, config=config, mask_value=MASK_VALUE)
        self.new_kv = {s.name: kv_tensor_index(layer=s.layer, kv_head=s.kv_head, is_value=s.role == KV_OUTPUT_ROLES[1],
                                               num_kv_heads=config.num_kv_heads)
                       for s in entry.outputs if s.role in KV_OUTPUT_ROLES}
        self._groups: list | None = None

    @property
    def groups(self) -> list:
        if self._groups is None:
            kv_layer = {s.name: s.layer for s in (*self.entry.inputs, *self.entry.outputs) if s.layer is not None}
            self._groups = split_template(self.float_dir / self.entry.file, kv_layer=kv_layer,
                                          num_layers=self.config.num_layers, hidden_size=self.config.hidden_size,
                                          max_bytes=self.max_bytes)
        return self._groups

    def fits(self, start: int, count: int) -> bool:
        return start <= self.entry.shape.past_len and count <= self.entry.shape.ar


def _sweep(ladder: list[_GroupedGraph], jobs: list[tuple[_Sequence, int, int]], on_logits) -> None:
    """Each job's rows through every group, one group's weights in memory at a time; each job in the smallest window
    of the ladder that holds its rows (as the Engine picks). Within a group the graphs run smallest window first, so
    a sequence's rows still run in order (a later row reads an earlier one's KV: a sequence only grows into larger
    windows). on_logits(sequence, first row, logits [rows, V]) with the last group's."""
    graph_of = [next(g for g in ladder if g.fits(start, count)) for _seq, start, count in jobs]
    used = [g for g in ladder if g in graph_of]
    hidden: list[np.ndarray | None] = [None] * len(jobs)
    for k in range(len(used[0].groups) if used else 0):
        for graph in used:
            group = graph.groups[k]
            session = cpu_session(group.path, prepack=False)  # made again every sweep: see cpu_session
            wanted = {v.name for v in group.proto.graph.input}
            outputs = [o.name for o in group.proto.graph.output]
            for i, (seq, start, count) in enumerate(jobs):
                if graph_of[i] is not graph:
                    continue
                step = TraceStep(seq.kv[:, :start], np.asarray(seq.tokens[start:start + count], np.int64), start)
                feeds = {n: v for n, v in graph.feeds.feeds(step, only=wanted).items() if n in wanted}
                if group.hidden_in is not None:
                    feeds[group.hidden_in] = hidden[i]
                values = dict(zip(outputs, session.run(outputs, feeds)))
                for name, value in values.items():
                    if name in graph.new_kv:
                        seq.kv[graph.new_kv[name], start:start + count] = value[0, 0, :count]  # [1, 1, AR, D]
                hidden[i] = values.get(group.hidden_out) if group.hidden_out else None
                if "logits" in values:
                    on_logits(seq, start, values["logits"][0, :count])  # [1, AR, V]
            del session
            release_memory()


class _Ranges:
    def __init__(self) -> None:
        self.logits_min, self.logits_max = np.inf, -np.inf

    def logits(self, seq: _Sequence, start: int, rows: np.ndarray) -> None:
        seq.logits = rows[-1].copy()  # a view would keep the run's whole [1, AR, V] logits alive with the sequence
        for i, row in enumerate(rows):
            if start + i in seq.run_ends:
                self.logits_min = min(self.logits_min, float(row.min()))
                self.logits_max = max(self.logits_max, float(row.max()))


def _ladders(float_dir: Path, fm: Manifest, *, max_bytes: int) -> tuple[list[_GroupedGraph], list[_GroupedGraph]]:
    """The decode graphs and the prefill graphs of the most rows, smallest window first."""
    prefill = fm.graphs_of(GraphKind.PREFILL)
    chunk = max(g.shape.ar for g in prefill)
    return tuple([_GroupedGraph(float_dir, e, config=fm.model, max_bytes=max_bytes) for e in entries]
                 for entries in (fm.graphs_of(GraphKind.DECODE), [g for g in prefill if g.shape.ar == chunk]))


def _chunks(seq: _Sequence, start: int, end: int, *, chunk: int, max_start: int) -> tuple[list, list]:
    """Jobs for rows [start, end): chunks for the prefill graph while its window holds the rows before them
    (max_start), then one row a job for the decode graph, as the Engine runs them."""
    chunks = [(seq, a, min(chunk, end - a)) for a in range(start, min(end, max_start + 1), chunk)]
    after = chunks[-1][1] + chunks[-1][2] if chunks else start
    return chunks, [(seq, a, 1) for a in range(after, end)]


def record_traces_streamed(float_dir: Path, fm: Manifest, prompt_ids: list[list[int]], *, max_steps: int,
                           max_new_tokens: int, eos_ids: tuple[int, ...] = (), sink_ids: tuple[int, ...] = (),
                           on_prompt=None, max_past_rows: int | None = None,
                           max_bytes: int = MAX_GROUP_BYTES) -> Traces:
    """record_traces's traces (same arguments, fm: the float family's manifest), one layer group in memory at a
    time (see the module docstring for what differs)."""
    decode, prefill = _ladders(float_dir, fm, max_bytes=max_bytes)
    chunk, max_context = prefill[-1].entry.shape.ar, decode[-1].entry.shape.past_len + 1
    room, max_rows = max_context - 1, max_past_rows or max_context
    run = _Run(decode=decode, prefill=prefill, chunk=chunk, room=room, max_rows=max_rows,
               max_prefill_start=prefill[-1].entry.shape.past_len, num_tensors=len(decode[0].new_kv),
               head_dim=fm.model.head_dim, ranges=_Ranges())
    keep = max(room - max_new_tokens, 1)
    prompt_ids = [p[-keep:] for p in prompt_ids]
    reach = max(map(len, prompt_ids), default=0) + max_new_tokens
    num_long = max_steps // 2 if len(prompt_ids) > 1 and reach < room else 0
    num_short = max_steps - num_long

    sinks = [run.sequence([t], 1) for t in sink_ids]
    chats = [run.sequence(ids, min(len(ids) + max_new_tokens, room)) for ids in prompt_ids]
    _prefill(run, sinks, chats)
    _answer_in_lockstep(run, chats, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    steps = _selected_steps(run, chats, prompt_ids, num_short=num_short, max_new_tokens=max_new_tokens,
                            on_prompt=on_prompt)
    replay: list[TraceStep] = []
    long = None
    if num_long:
        long, long_steps, replay = _long_steps(run, chats, prompt_ids, num_long=num_long)
        steps += long_steps
    kv_min, kv_max = _kv_range(run, [*sinks, *chats, *([long] if long else [])])
    sink_steps = [_step(seq, 0, seq.tokens[:1], max_rows) for seq in [*sinks, *chats]]
    return Traces(steps=tuple(steps) + tuple(sink_steps), kv_min=kv_min, kv_max=kv_max,
                  logits_min=run.ranges.logits_min, logits_max=run.ranges.logits_max, replay_steps=tuple(replay))


@dataclass
class _Run:
    """One recording's graphs (the decode and prefill ladders, by layer group) and limits."""

    decode: list
    prefill: list
    chunk: int  # the prefill graph's rows
    room: int  # the rows a sequence may hold
    max_rows: int  # the past rows a trace step keeps
    max_prefill_start: int
    num_tensors: int
    head_dim: int
    ranges: _Ranges

    def sequence(self, tokens: list[int], capacity: int) -> _Sequence:
        return _Sequence(list(tokens), np.zeros((self.num_tensors, capacity, self.head_dim), np.float32))

    def sweep(self, chunks: list, rows: list) -> None:
        """Prompt chunks on the prefill ladder, then single rows on the decode ladder."""
        _sweep(self.prefill, chunks, self.ranges.logits)
        if rows:
            _sweep(self.decode, rows, self.ranges.logits)


def _prefill(run: _Run, sinks: list[_Sequence], chats: list[_Sequence]) -> None:
    """The first tokens alone, then every prompt: its first token alone (the sink), its chunks."""
    jobs, tail = [], []
    for seq in sinks:
        seq.run_ends.add(0)
        jobs.append((seq, 0, 1))
    for seq in chats:
        chunk = run.chunk
        seq.run_ends.update({0, *(min(a + chunk, len(seq.tokens)) - 1 for a in range(1, len(seq.tokens), chunk))})
        chunks, rows = _chunks(seq, 1, len(seq.tokens), chunk=chunk, max_start=run.max_prefill_start)
        jobs += [(seq, 0, 1), *chunks]
        tail += rows
    run.sweep(jobs, tail)
    for seq in sinks + chats:
        seq.num_rows = len(seq.tokens)


def _answer_in_lockstep(run: _Run, chats: list[_Sequence], *, max_new_tokens: int, eos_ids: tuple[int, ...]
                        ) -> None:
    """One greedy token of every unfinished answer a sweep."""
    active = list(chats)
    for _ in range(max_new_tokens):
        jobs = []
        for seq in active:
            token = int(np.argmax(seq.logits))
            if token in eos_ids or seq.num_rows + 1 > run.room:
                continue
            seq.tokens.append(token)
            seq.answer.append(token)
            seq.run_ends.add(seq.num_rows)
            jobs.append((seq, seq.num_rows, 1))
            seq.num_rows += 1
        if not jobs:
            break
        _sweep(run.decode, jobs, run.ranges.logits)
        active = [seq for seq, _start, _count in jobs]


def _selected_steps(run: _Run, chats: list[_Sequence], prompt_ids: list[list[int]], *, num_short: int,
                    max_new_tokens: int, on_prompt) -> list[TraceStep]:
    """record_traces's selection, prompt by prompt: every chunk_stride-th prompt chunk and decode_stride-th
    answer token, num_short steps at most."""
    chunk = run.chunk
    num_chunks = sum(-(-len(p) // chunk) for p in prompt_ids)
    num_decode = len(prompt_ids) * max_new_tokens
    chunk_stride = max(1, -(-num_chunks // max(1, num_short // 2)))
    decode_stride = max(1, -(-num_decode // max(1, num_short - min(num_chunks, num_short // 2))))
    steps: list[TraceStep] = []
    chunk_no = decode_no = 0
    for seq, ids in zip(chats, prompt_ids):
        for start in range(1, len(ids), chunk):
            if chunk_no % chunk_stride == 0:
                steps.append(_step(seq, start, ids[start:start + chunk], run.max_rows))
            chunk_no += 1
        for i, token in enumerate(seq.answer):
            if decode_no % decode_stride == 0:
                steps.append(_step(seq, len(ids) + i, [token], run.max_rows))
            decode_no += 1
        if on_prompt is not None:
            on_prompt()
    return steps[:num_short]


def _long_steps(run: _Run, chats: list[_Sequence], prompt_ids: list[list[int]], *, num_long: int
                ) -> tuple[_Sequence, list[TraceStep], list[TraceStep]]:
    """The long conversation (the prompts and their answers one after another): its sequence, its steps and the
    replay of its every chunk."""
    chunk = run.chunk
    long, long_steps = _long_conversation(prompt_ids, [c.answer for c in chats], room=run.room, chunk=chunk,
                                          num_steps=num_long, make=lambda tokens: run.sequence(tokens, run.room + 1))
    run.sweep(*_chunks(long, 0, len(long.tokens), chunk=chunk, max_start=run.max_prefill_start))
    long.num_rows = len(long.tokens)
    steps = [_step(long, start, tokens, run.max_rows) for start, tokens in long_steps]
    replay = [_step(long, p, long.tokens[p:p + chunk], run.max_rows)
              for p in range(1, len(long.tokens) - chunk + 1, chunk)]
    return long, steps, replay


def _kv_range(run: _Run, sequences: list[_Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """Per KV tensor, the least and greatest value of every row recorded: [num_tensors] each."""
    kv_min, kv_max = np.full(run.num_tensors, np.inf, np.float32), np.full(run.num_tensors, -np.inf, np.float32)
    for seq in sequences:
        rows = seq.kv[:, :seq.num_rows]
        if rows.shape[1]:
            np.minimum(kv_min, rows.min(axis=(1, 2)), out=kv_min)
            np.maximum(kv_max, rows.max(axis=(1, 2)), out=kv_max)
    return kv_min, kv_max


def _step(seq: _Sequence, start: int, tokens, max_rows: int) -> TraceStep:
    return TraceStep(window_rows(seq.kv[:, :start], max_rows).copy(), np.asarray(tokens, np.int64), start)


def _long_conversation(prompt_ids: list[list[int]], answers: list[list[int]], *, room: int, chunk: int,
                       num_steps: int, make) -> tuple[_Sequence, list[tuple[int, list[int]]]]:
    """traces._long_conversation's sequence with each prompt's own answer, and its steps (first row, tokens): the
    prompts one after another, round after round until the context is full; a step every room / num_steps rows."""
    every = max(1, room // num_steps)
    tokens: list[int] = []
    ends: set[int] = set()
    steps: list[tuple[int, list[int]]] = []

    def run(part: list[int]) -> None:
        if len(tokens) >= every * (len(steps) + 1):
            steps.append((len(tokens), part))
        tokens.extend(part)
        ends.add(len(tokens) - 1)

    def done() -> tuple[_Sequence, list[tuple[int, list[int]]]]:
        seq = make(tokens)
        seq.run_ends = ends
        return seq, steps[:num_steps]

    while True:
        for ids, answer in zip(prompt_ids, answers):
            for start in range(0, len(ids), chunk):
                part = ids[start:start + chunk]
                if len(tokens) + len(part) > room:
                    return done()
                run(part)
            for token in answer:
                if len(tokens) + 1 > room:
                    return done()
                run([token])
        if not any(answers) and not any(prompt_ids):
            return done()
