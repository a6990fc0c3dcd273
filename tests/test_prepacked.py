"""One copy of a CPU family's weights: every session maps one packed file, one session serves every in-place shape,
and a machine short of memory is told before any session opens."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL, graph_path

from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.session.device import Device, DeviceOptions
from staticlm.runtime.session.prepacked import PACKED_FILE, packed_bytes, prepared_path, store_dir

CPU = EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS))


def _export(hf_dir: Path, out: Path, **cpu_kw) -> Path:
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    export_cpu_family(load_model(hf_dir), out, cpu=CpuOptions(**cpu_kw),
                      options=ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,),
                                            batch_sizes=(2,)))
    return out


@pytest.fixture(scope="module")
def families(tiny_hf_dir, tmp_path_factory) -> dict[str, Path]:
    from staticlm.export.cpu.graph import CpuAttention

    root = tmp_path_factory.mktemp("prepacked")
    return {"gqa": _export(tiny_hf_dir, root / "gqa"),
            "windows": _export(tiny_hf_dir, root / "windows", attention=CpuAttention.WINDOWS)}


def _store(family: Path) -> Path:
    from staticlm.runtime.family.manifest import load_manifest

    return store_dir(family, load_manifest(family).weights_sha256)


def _prepared(family: Path) -> list[Path]:
    """The optimized graphs the store's sessions load (beside the family's own graphs)."""
    return sorted(family.glob(f".{_store(family).name}.*.prepacked"))


def _external(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}


def test_one_session_serves_every_in_place_shape(families):
    engine = Engine(families["gqa"], options=CPU)
    engine.warm_up()  # decode, the prompt chunk and the verify graph
    engine.prefill(list(range(3, 3 + 2 * TINY_PREFILL + 3)))
    engine.verify(np.array([5, 6, 7]))
    batch = Engine(families["gqa"], options=CPU, batch=2, weights_from=engine)
    batch.load_prefix(engine)
    batch.decode_batch(np.array([5, 6]), active=np.ones(2, bool))
    assert engine.sessions.files == {families["gqa"] / "in_place.onnx"}
    assert batch.sessions is engine.sessions


def test_sessions_read_the_packed_file_and_graphs_share_its_blobs(families):
    family = families["windows"]  # a file per (batch, AR): the store keeps their common weights once
    engine = Engine(family, options=CPU)
    engine.prefill(list(range(3, 3 + TINY_PREFILL + 1)))  # the prompt-chunk graph, then a decode graph
    store = _store(family)
    assert len(_prepared(family)) >= 2
    size = packed_bytes(store)
    engine.load_all()  # every other graph of the family: their weights are the same bytes
    assert packed_bytes(store) <= size + (64 << 10) * len(_prepared(family))
    packed_location = f".ort_cache/{store.name}/{PACKED_FILE}"
    for path in _prepared(family):
        model = onnx.load(str(path), load_external_data=False)
        external = _external(model)
        # the store's own file, and the family's weights.bin itself, in place, for what ORT left as is
        locations = {e["location"] for e in external.values()}
        assert packed_location in locations and locations <= {packed_location, "weights.bin"}
        packed = {n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"}
        assert packed and all(any(k.startswith("prepacked") for k in external[name]) for name in packed), path


def test_the_stored_graph_computes_what_the_source_graph_computes(families, rng):
    """The store relocates every tensor and packed blob: ORT on the rewritten graph against ORT on the source."""
    family = families["gqa"]
    Engine(family, options=CPU).warm_up()
    source = graph_path(family, "decode", ar=1)
    stored = prepared_path(source, _store(family))
    from staticlm.runtime.family.manifest import load_manifest

    cfg = load_manifest(family).model
    rows, hkv, d = 8, cfg.num_kv_heads, cfg.head_dim
    feeds = {"input_ids": np.array([[7, 9, 11]]), "position_ids": np.array([[5, 6, 7]]),
             "seqlens_k": np.array([7], np.int32), "total_sequence_length": np.array(8, np.int32),
             "query_seqlens": np.array([3], np.int32), "logits_index": np.array([0, 1, 2])}
    for layer in range(cfg.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{layer}"] = rng.standard_normal((1, hkv, rows, d)).astype(np.float32)
    outputs = {}
    for path in (source, stored):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs[path] = session.run(None, feeds)
    for got, want in zip(outputs[stored], outputs[source], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_store_cut_short_is_rebuilt(families):
    family = families["gqa"]
    ids = list(range(3, 3 + TINY_PREFILL + 5))
    first = Engine(family, options=CPU).prefill(ids)
    store = _store(family)
    packed = store / PACKED_FILE
    with open(packed, "r+b") as f:
        f.truncate(packed.stat().st_size // 2)
    again = Engine(family, options=CPU).prefill(ids)
    np.testing.assert_array_equal(again, first)
    assert packed.stat().st_size > 0


def test_a_machine_short_of_memory_is_told_before_any_session(families, monkeypatch):
    import psutil

    from staticlm.errors import UserError
    from staticlm.runtime.family.manifest import load_manifest
    from staticlm.runtime.session.device import create_session  # noqa: F401 -- must not be reached

    class Small:
        available = 1000

    opened = []
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small())
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(UserError) as err:
        Engine(families["gqa"], options=CPU)
    message = str(err.value)
    weights = load_manifest(families["gqa"]).weights_bytes
    assert "\n" not in message and "needs about" in message and f"{weights / 1e9:.2f} GB" in message
    assert not opened


def _resident(path: Path) -> int:
    """This process's resident bytes of its private mappings of path."""
    from staticlm.apps.bench.mappings import by_mapping

    return by_mapping(os.getpid()).get(str(path.resolve()), None).rss


def test_pages_read_only_while_opening_are_given_back(tmp_path):
    import mmap

    from staticlm.runtime.session.read_once import drop_read_once

    page = mmap.PAGESIZE
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 255, 64 * page, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        clean = mmap.mmap(f.fileno(), 32 * page, access=mmap.ACCESS_COPY)  # private, as ORT maps a tensor
        written = mmap.mmap(f.fileno(), 32 * page, access=mmap.ACCESS_COPY, offset=32 * page)
    sum(clean[i] for i in range(0, 32 * page, page))  # read every page
    written[5] = (written[5] + 1) % 256  # a private copy of a page: this window must be kept as it is
    before = _resident(path)
    advised = drop_read_once(tmp_path, {"weights.bin": [(page + 7, 10 * page), (32 * page, 32 * page)]})
    assert advised == 9 * page  # whole pages inside the first range; the written window untouched
    assert before - _resident(path) == 9 * page
    assert bytes(clean[:]) == data[:32 * page].tobytes()  # the pages fault back from the file, the same bytes
    assert written[5] == (int(data[32 * page + 5]) + 1) % 256


def test_a_family_gives_back_the_scales_its_packed_blobs_hold(families):
    from staticlm.runtime.session.read_once import read_once_ranges

    engine = Engine(families["gqa"], options=CPU)
    engine.warm_up()
    graph = prepared_path(families["gqa"] / "in_place.onnx", _store(families["gqa"]))
    model = onnx.load(str(graph), load_external_data=False)
    external = _external(model)
    ranges = read_once_ranges(graph)
    offsets = {(e["location"], int(e.get("offset", 0))) for e in external.values()}
    listed = {(name, offset) for name, spans in ranges.items() for offset, _ in spans}
    assert listed <= offsets
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.input[2] in external:
            scales = external[node.input[2]]
            assert (scales["location"], int(scales.get("offset", 0))) in listed
            assert not any(k.startswith("prepacked") for k in scales)  # never a packed blob
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)


def _tensor_keys(path: Path, ranges) -> set[str]:
    import hashlib

    with open(path, "rb") as f:
        data = f.read()
    return {hashlib.sha256(data[o:o + n]).hexdigest() for o, n in ranges}


def test_the_weight_file_keeps_one_link_and_the_store_no_copy_of_it(families):
    """The store reads weights.bin in place (no hard link: onnx refuses to load a graph whose external data has
    several links), and holds none of its tensors a second time."""
    family = families["gqa"]
    Engine(family, options=CPU).warm_up()
    weights = family / "weights.bin"
    assert os.stat(weights).st_nlink == 1
    source = graph_path(family, "decode", ar=1)
    assert onnx.load(str(source), load_external_data=True).graph.initializer  # no "potential hardlink attack"
    prepared = prepared_path(source, _store(family))
    assert onnx.load(str(prepared), load_external_data=True).graph.initializer  # in place, and the store's file
    # nothing in the store but packed.bin holds data; and packed.bin none of weights.bin's tensors (its packed
    # tensors aside: ORT reads their blobs from their own file)
    store = _store(family)
    others = [p for p in store.rglob("*") if p.is_file() and p.name != PACKED_FILE]
    assert sum(p.stat().st_size for p in others) < 64 << 10, others
    external = _external(onnx.load(str(source), load_external_data=False))
    in_weights = _tensor_keys(weights, [(int(e.get("offset", 0)), int(e["length"])) for e in external.values()])
    copied = [(int(e.get("offset", 0)), int(e["length"])) for e in _external(onnx.load(str(prepared),
              load_external_data=False)).values() if e["location"].endswith(PACKED_FILE)
              and not any(k.startswith("prepacked") for k in e)]
    assert not _tensor_keys(store / PACKED_FILE, copied) & in_weights


def test_a_store_that_hard_linked_the_weights_is_rebuilt(families, tmp_path):
    """An older staticlm's store: weights.bin hard-linked into it, its graphs and their stamps there (and none of
    this version's graphs). Opened now, the link goes (weights.bin readable by onnx again), the packed file is kept,
    and the answers are the same."""
    import shutil

    family = tmp_path / "family"
    shutil.copytree(families["gqa"], family, ignore=shutil.ignore_patterns(".*"))
    ids = list(range(3, 3 + TINY_PREFILL + 5))
    first = Engine(family, options=CPU).prefill(ids)
    store = _store(family)
    for path in [*_prepared(family), *store.glob("*.prepared")]:  # as the older store was: its graphs inside
        path.unlink()
    os.link(family / "weights.bin", store / "weights.bin")
    shutil.copy(family / "in_place.onnx", store / "in_place.onnx")
    (store / "in_place.source").write_text(f"{'0' * 64} {packed_bytes(store)} weights.bin")
    size = packed_bytes(store)
    assert os.stat(family / "weights.bin").st_nlink == 2
    again = Engine(family, options=CPU).prefill(ids)
    np.testing.assert_array_equal(again, first)
    assert os.stat(family / "weights.bin").st_nlink == 1 and not list(store.glob("*.onnx"))
    assert packed_bytes(store) == size  # its blobs were there already


def test_a_table_gathered_by_rows_maps_a_page_a_row(tmp_path):
    import mmap

    from staticlm.runtime.session.read_once import map_tables_by_rows

    page, row_bytes = mmap.PAGESIZE, 1536
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(1).integers(0, 255, 1024 * page, dtype=np.uint8)
    path.write_bytes(data.tobytes())  # just written: the page cache's folios are as large as the kernel makes them
    with open(path, "rb") as f:
        table = mmap.mmap(f.fileno(), 1024 * page, access=mmap.ACCESS_COPY)  # private, as ORT maps a tensor
    assert map_tables_by_rows(tmp_path, {"weights.bin": [(0, 1024 * page)]}) == 1024 * page
    rows = np.random.default_rng(2).choice(1024 * page // row_bytes, 40, replace=False)
    got = [table[r * row_bytes:(r + 1) * row_bytes] for r in rows]  # 40 rows, gathered as an embedding does
    assert got == [data[r * row_bytes:(r + 1) * row_bytes].tobytes() for r in rows]  # the file's bytes
    assert _resident(path) <= 2 * 40 * page  # each row's own one or two pages, not the folios around them


def test_the_tables_mapped_by_rows_are_the_gathers_that_nothing_reads_whole(families):
    from staticlm.runtime.session.read_once import table_ranges

    Engine(families["gqa"], options=CPU).warm_up()
    source = families["gqa"] / "in_place.onnx"
    graph = prepared_path(source, _store(families["gqa"]))
    model = onnx.load(str(graph), load_external_data=False)
    external = _external(model)
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    want = {(external[name]["location"], int(external[name].get("offset", 0)), int(external[name]["length"]))
            for name in gather.input if name in external}
    assert len(want) >= 2  # the tied table, its scales (and zero points, when the head has them)
    assert {(name, *span) for name, spans in table_ranges(graph).items() for span in spans} == want
    # in the exported graph the tied head's MatMulNBits reads the same bytes whole, every step: left as they are
    assert table_ranges(source) == {}
