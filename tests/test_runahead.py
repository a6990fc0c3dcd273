"""Layer-group parts (export/parts.py) and KV-Runahead's parallel prefill (runtime/engine/runahead.py, seed 003).

References: the family's own whole graphs (each part is cut out of one, so the chain must reproduce it), and the
ordinary single-worker prefill for the KV cache the workers fill; brute force for the partition searches.
"""
from __future__ import annotations

import itertools
import math
import threading
import time

import numpy as np
import onnx
import pytest
from conftest import graph_path

from staticlm.errors import UserError
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.engine.partition import (
    PartitionTable,
    binary_search_split,
    grid_search,
    modeled_ttft,
    sizes_from_fractions,
)
from staticlm.runtime.engine.parts import ChainRunner
from staticlm.runtime.engine.runahead import RowSync
from staticlm.runtime.session.device import DeviceOptions

CONTEXT, PREFILL = 128, 8
PROMPT = np.random.default_rng(7).integers(0, 256, 57)  # 57 rows: 7 prompt-graph chunks and a ragged one


def _options():
    from staticlm.export.family import ExportOptions

    return ExportOptions(contexts=(CONTEXT,), prefill_len=PREFILL, verify_lens=(4,), batch_sizes=())


@pytest.fixture(scope="module")
def families(tiny_hf_dir, tmp_path_factory):
    """The tiny model's cpu (in-place) and float (per-head windows) families, each with 2 layer-group parts."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.family import export_family
    from staticlm.export.parts import add_parts
    from staticlm.export.sources import load_model

    root = tmp_path_factory.mktemp("parts")
    model = load_model(tiny_hf_dir)
    export_cpu_family(model, root / "cpu", options=_options())
    export_family(model, root / "float", options=_options())
    for name in ("cpu", "float"):
        add_parts(root / name, 2)
    return {"cpu": root / "cpu", "float": root / "float"}


def _greedy(engine: Engine, prompt, num_tokens: int) -> tuple[list[int], np.ndarray]:
    logits = engine.prefill(prompt).copy()
    first, tokens = logits, []
    for _ in range(num_tokens):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode(tokens[-1])
    return tokens, first


def _assert_chain_matches_whole(family, *, num_tokens: int = 12) -> None:
    whole, chain = Engine(family), Engine(family, options=EngineOptions(run_parts=True))
    expected, expected_logits = _greedy(whole, PROMPT, num_tokens)
    tokens, logits = _greedy(chain, PROMPT, num_tokens)
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chain.kv.valid_block(0).astype(np.float32),
                               whole.kv.valid_block(0).astype(np.float32), atol=1e-5)
    ran = [r for r in chain._runners.values() if isinstance(r, ChainRunner)]
    assert ran and all(len(r.parts) == 2 for r in ran)  # the chain ran, not the whole graphs
    assert all(".part" in f.name for f in chain.sessions.files)


@pytest.mark.parametrize("name", ["cpu", "float"])
def test_parts_chain_generation_equals_the_whole_family(families, name):
    _assert_chain_matches_whole(families[name])


def _position_nodes(graph) -> int:
    """The nodes computed from the positions alone (position_ids, the RoPE tables, small constants)."""
    known = {"position_ids"} | {t.name for t in graph.initializer
                                if t.name.startswith("rope_") or np.prod(t.dims, dtype=np.int64) <= 8}
    count = 0
    for node in graph.node:
        if all(name in known for name in node.input if name):
            known.update(node.output)
            count += 1
    return count


def test_each_part_reads_only_its_layers_weights_and_no_node_runs_twice(families):
    family = families["cpu"]
    path = graph_path(family, "prefill", ar=8)
    whole = onnx.load(path, load_external_data=False).graph
    parts = [onnx.load(path.with_name(f"{path.stem}.part{k}.onnx"), load_external_data=False).graph for k in range(2)]
    # every part with attention makes its own RoPE rows from the positions (a few element-wise nodes); all the rest
    # runs in exactly one part
    assert _position_nodes(whole) > 0 and all(_position_nodes(p) == _position_nodes(whole) for p in parts)
    assert sum(len(p.node) - _position_nodes(p) for p in parts) == len(whole.node) - _position_nodes(whole)
    for k, part in enumerate(parts):
        # layer k's projections and norms; the next layer's input norm too (the cpu graph norms it where the
        # residual is summed, and the cut passes the normed rows on)
        names = {t.name for t in part.initializer if t.name[:1] == "l" and "." in t.name}
        assert {n for n in names if not n.endswith("attn_norm")} == {
            n for n in names if n.startswith(f"l{k}.") and not n.endswith("attn_norm")} != set()
        assert {n.split(".")[0] for n in names if n.endswith(".qkv.q")} == {f"l{k}"}
        kv = {i.name for i in part.input if i.name.startswith("past_")}
        assert kv == {f"past_key_{k}", f"past_value_{k}"}


def test_htp_parts_chain_equals_the_whole_quantized_family(tiny_hf_dir, tmp_path):
    from staticlm.export.calibration.traces import calibration_prompts
    from staticlm.export.family import ExportOptions
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.parts import add_parts
    from staticlm.export.sources import load_model

    out = tmp_path / "htp"
    export_quantized_family(load_model(tiny_hf_dir), out, quant=QuantOptions(calib_steps=8),
                            options=ExportOptions(contexts=(64,), prefill_len=8, verify_lens=(4,), batch_sizes=()),
                            prompts=calibration_prompts()[:2])
    add_parts(out, 2)
    _assert_chain_matches_whole(out, num_tokens=4)


def _engines(family, workers: int) -> tuple[Engine, Engine]:
    single = Engine(family)
    parallel = Engine(family, options=EngineOptions(prefill_workers=workers, device=DeviceOptions(num_threads=workers)))
    return single, parallel


@pytest.mark.parametrize("sizes", [[33, 24], [13, 28, 16], [30, 19, 8]])
def test_parallel_prefill_fills_the_cache_of_a_single_worker_prefill(families, sizes):
    single, parallel = _engines(families["cpu"], len(sizes))
    expected = single.prefill(PROMPT).copy()
    generation = parallel.kv.buffer_generation
    logits = parallel.runahead.prefill(PROMPT, sizes=sizes)
    assert parallel.num_cached == PROMPT.size
    np.testing.assert_allclose(parallel.kv.valid_block(0), single.kv.valid_block(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    # in place: the workers wrote the kv_manager's own buffer, nothing was copied or reallocated
    assert parallel.kv.stats.copied_rows == 0 and parallel.kv.buffer_generation == generation


def test_parallel_prefill_after_a_cached_prefix_continues_its_rows_and_positions(families):
    single, parallel = _engines(families["cpu"], 2)
    expected = single.prefill(PROMPT).copy()
    parallel.prefill(PROMPT[:11])  # 11 < 2 workers x 8 rows: the ordinary prefill
    assert parallel.runahead.num_tokens == 0
    logits = parallel.runahead.prefill(PROMPT[11:], sizes=[27, 19])
    np.testing.assert_allclose(parallel.kv.valid_block(0), single.kv.valid_block(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_run_options_open_the_workers_with_their_share_of_the_threads(families):
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    model = Model.open(families["cpu"], RunOptions(device="cpu", num_threads=4, prefill_workers=2, run_parts=True))
    engine = model.engine
    assert engine.runahead.num_workers == 2 and engine.runahead.threads_per_worker == 2
    assert engine.options.run_parts
    engine.warm_up()
    assert engine.num_cached == 0 and engine.runahead._runners is not None  # opened, nothing left cached
    assert _greedy(engine, PROMPT, 8)[0] == _greedy(Engine(families["cpu"]), PROMPT, 8)[0]


@pytest.mark.parametrize("workers", [2, 3])
def test_greedy_tokens_are_identical_with_prefill_workers(families, workers):
    single, parallel = _engines(families["cpu"], workers)
    assert parallel.runahead.takes(PROMPT.size)
    assert _greedy(parallel, PROMPT, 16)[0] == _greedy(single, PROMPT, 16)[0]
    assert parallel.runahead.num_tokens == PROMPT.size  # the workers prefilled the prompt


class RecordingSync(RowSync):
    """Logs every read and write of rows, in the order they happen, under one lock."""

    log: list[tuple] = []
    lock = threading.Lock()
    write_delay = 0.0

    def reading(self, worker, group, *, rows):
        with self.lock:
            self.log.append(("read", worker, group, rows))

    def wrote(self, worker, group, *, start, end):
        time.sleep(self.write_delay)  # widens the window a missing wait would read in
        with self.lock:
            self.log.append(("wrote", worker, group, start, end))


def _first_early_read(log, *, num_groups: int, num_rows: int):
    """Replays the log: the first read of a row no worker had written yet, or None."""
    written = np.zeros((num_groups, num_rows), bool)
    for event in log:
        if event[0] == "wrote":
            _, _w, g, start, end = event
            written[g, start:end] = True
        elif not written[event[2], :event[3]].all():
            return event
    return None


def test_four_parts_three_workers_fill_the_cache_of_a_single_worker_prefill(tmp_path):
    """More cuts than two: each worker's residual stream alternates between two banks (runahead.py)."""
    import torch
    from conftest import save_tiny_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.parts import add_parts
    from staticlm.export.sources import load_model

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    save_tiny_checkpoint(LlamaForCausalLM(config).eval(), tmp_path / "hf")
    export_cpu_family(load_model(tmp_path / "hf"), tmp_path / "cpu", options=_options())
    add_parts(tmp_path / "cpu", 4)
    single, parallel = _engines(tmp_path / "cpu", 3)
    expected = single.prefill(PROMPT).copy()
    np.testing.assert_allclose(parallel.runahead.prefill(PROMPT, sizes=[29, 17, 11]), expected, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(parallel.kv.valid_block(0), single.kv.valid_block(0), rtol=1e-5, atol=1e-5)


def test_no_worker_reads_a_row_before_it_is_written(families):
    _single, parallel = _engines(families["cpu"], 3)

    class Recording(RecordingSync):
        log = []
        write_delay = 0.002

    for sizes in ([24, 16, 17], [8, 8, 41], [41, 8, 8]):
        parallel.reset()
        Recording.log = []
        parallel.runahead.prefill(PROMPT, sizes=sizes, sync_class=Recording)
        reads = [e for e in Recording.log if e[0] == "read"]
        assert len(reads) == 2 * sum(-(-s // PREFILL) for s in sizes)  # every run of every group was seen
        assert _first_early_read(Recording.log, num_groups=2, num_rows=PROMPT.size) is None

    class NoWait(Recording):  # the same log with the waits taken out must be caught
        log = []

        def wait(self, group, rows):
            pass

        def publish(self, group, *, start, end):
            pass

    parallel.reset()
    parallel.runahead.prefill(PROMPT, sizes=[40, 9, 8], sync_class=NoWait)
    assert _first_early_read(NoWait.log, num_groups=2, num_rows=PROMPT.size) is not None


def test_prefill_workers_need_parts_and_the_in_place_layout(families, tiny_hf_dir, tmp_path):
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.sources import load_model

    with pytest.raises(UserError, match="in-place family"):
        Engine(families["float"], options=EngineOptions(prefill_workers=2))
    export_cpu_family(load_model(tiny_hf_dir), tmp_path / "plain", options=_options())
    with pytest.raises(UserError, match="--parts N"):
        Engine(tmp_path / "plain", options=EngineOptions(prefill_workers=2))
    with pytest.raises(UserError, match="--parts N"):
        Engine(tmp_path / "plain", options=EngineOptions(run_parts=True)).prefill(PROMPT)


def _seed_cost(sizes: list[int]) -> float:
    """The seed's chain with attention growing in the rows attended to (4 groups)."""
    return modeled_ttft(sizes, num_groups=4, group_seconds=lambda _g, c, s: c * (1.0 + 0.01 * (s + c / 2)))


def test_partition_searches_find_the_brute_force_optimum_of_the_seed_model():
    n, align = 256, 8
    splits2 = [[a, n - a] for a in range(align, n, align)]
    best2 = min(_seed_cost(s) for s in splits2)
    found2 = binary_search_split(_seed_cost, n, align=align)
    assert sum(found2) == n and _seed_cost(found2) == pytest.approx(best2)
    assert found2[0] > found2[1]  # the earlier chunk is longer, as the seed finds
    splits3 = [[a, b - a, n - b] for a, b in itertools.combinations(range(align, n, align), 2)]
    best3 = min(_seed_cost(s) for s in splits3)
    found3 = grid_search(_seed_cost, n, 3, align=align)
    assert sum(found3) == n and _seed_cost(found3) <= best3 * 1.01
    assert found3[0] > found3[1] > found3[2]


def test_partition_table_interpolates_between_context_lengths_and_round_trips(tmp_path):
    table = PartitionTable()
    table.add(1000, [600, 400])
    table.add(2000, [1400, 600])
    assert table.fractions(2, 1500) == pytest.approx((0.65, 0.35))
    assert table.fractions(2, 500) == pytest.approx((0.6, 0.4))  # the nearest entry outside the table
    assert table.fractions(3, 1500) is None
    path = table.save(tmp_path / "t.json")
    assert PartitionTable.load(path).entries == table.entries
    sizes = sizes_from_fractions(1500, table.fractions(2, 1500), align=64)
    assert sum(sizes) == 1500 and sizes[0] % 64 == 0 and sizes[0] == 960


def test_export_command_writes_parts_and_refuses_more_parts_than_layers(tiny_hf_dir, tmp_path):
    from staticlm.apps.commands.export import run_export
    from staticlm.runtime.engine.parts import part_layers
    from staticlm.runtime.family.manifest import load_manifest

    common = {"model": str(tiny_hf_dir), "contexts": "64", "prefill_len": 8, "verify_lens": "4",
              "batch_sizes": "none", "quiet": True}
    with pytest.raises(UserError, match=r"--parts must be in 1\.\.2"):
        run_export(out_dir=tmp_path / "three", parts=3, **common)
    assert not (tmp_path / "three").exists()  # refused before anything was written
    run_export(out_dir=tmp_path / "two", parts=2, **common)
    assert part_layers(load_manifest(tmp_path / "two")) == [(0, 1), (1, 2)]


def test_bench_row_measures_both_ways_stores_the_table_and_plots(families, tmp_path, monkeypatch):
    from staticlm.apps.bench import runahead as bench_runahead
    from staticlm.apps.bench.base import BenchOptions
    from staticlm.apps.bench.command import run_bench

    monkeypatch.setenv("STATICLM_CACHE", str(tmp_path / "cache"))  # the table goes here, not the user's cache
    monkeypatch.setattr(bench_runahead, "QUICK_LENGTHS", (48, 96))  # what the tiny family's 128 rows hold
    result = run_bench(BenchOptions(model_dir=families["cpu"], quick=True, only=("runahead",), out_dir=tmp_path / "o"),
                       show=False)
    rows = {r.key: r.ours for r in result["rows"]}
    for n in (48, 96):
        for key in ("2w1t", "1w2t", "even"):
            assert math.isfinite(rows[f"runahead.ttft@{n}.{key}"]) and rows[f"runahead.ttft@{n}.{key}"] > 0
    assert rows["runahead.model@96.4w"] > 0 and rows["runahead.model@96.8w"] > 0
    assert "runahead.model@48.8w" not in rows  # 48 rows cannot give 8 workers a whole 8-row chunk each
    table = PartitionTable.load(tmp_path / "cache" / "runahead_partition.json")
    assert set(table.entries[2]) == {48, 96} and set(table.entries[4]) == {48, 96}
    assert all(abs(sum(f) - 1) < 1e-9 for by_n in table.entries.values() for f in by_n.values())
    assert (tmp_path / "o" / "runahead_ttft.png").stat().st_size > 0
