"""`staticlm serve --cache-dir`: the prompt cache saved to disk and loaded back by a new model and loop (slots.py).

The reference for every answer is a cold run on a model that never saw the cache: a restart must give the same
greedy tokens while reporting the saved prefix as cached."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, build_tiny_hf, export_in_place

PARAMS_KW = {"max_new_tokens": 10, "ignore_eos": True}
TEXTS = ("abcabc abd zz top " * 4, "The cat sat on the mat. " * 3, "q r s t u v w x y z " * 3)


def _open(family: Path):
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    return Model.open(family, RunOptions(device="cpu", num_threads=THREADS))


def _store(model, directory: Path, **kw):
    from staticlm.runtime.generate.slots import SlotStore

    return SlotStore.for_engine(directory, model.engine, max_entries=model.loop.max_saved_prefixes, **kw)


def _answer(loop, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Submit the prompts together and step until all end: per prompt, (cached tokens, its greedy tokens)."""
    from staticlm.runtime.generate.sequence_request import Admitted, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    events: list[list] = [[] for _ in prompts]
    for ids, evs in zip(prompts, events):
        loop.submit(SequenceRequest(prompt_ids=ids, params=GenerationParams(**PARAMS_KW), on_event=evs.append))
    while loop.step():
        pass
    out = []
    for evs in events:
        [admitted] = [e for e in evs if isinstance(e, Admitted)]
        [done] = [e for e in evs if isinstance(e, Finished)]
        out.append((admitted.num_cached_tokens, list(done.token_ids)))
    return out


@pytest.fixture(scope="module")
def prompts(in_place_family) -> list[list[int]]:
    tok = _open(in_place_family).tokenizer
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def cold(in_place_family, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens from an empty cache (the reference)."""
    from staticlm.runtime.generate.text_stream import GenerationParams

    model = _open(in_place_family)
    want = []
    for ids in prompts:
        model.generator.reset()
        want.append(model.generate(ids, GenerationParams(**PARAMS_KW)).token_ids)
    return want


@pytest.fixture(scope="module")
def saved(in_place_family, prompts, cold, tmp_path_factory) -> Path:
    """A cache dir saved by a loop that answered two prompts together (rows) and then one alone (the lane)."""
    model = _open(in_place_family)
    loop = model.open_loop(eager=True)
    first = _answer(loop, prompts[:2]) + _answer(loop, prompts[2:])
    assert [c for c, _ in first] == [0, 0, 0] and [t for _, t in first] == cold
    directory = tmp_path_factory.mktemp("slots")
    _store(model, directory).save(loop.cached_prefixes())
    return directory


def test_a_restart_answers_saved_prompts_from_the_cache_with_the_cold_tokens(in_place_family, prompts, cold,
                                                                            saved, tmp_path):
    files = sorted(saved.glob("*.slot"))
    assert len(files) == 3 and not list(saved.glob(".*"))  # two rows and the lane, no temp file left
    model, reference = _open(in_place_family), _open(in_place_family)
    loop = model.open_loop(eager=True)
    assert len(files) <= loop.max_saved_prefixes
    assert loop.restore_prefixes(_store(model, saved).load()) == 3
    for r in loop.cache.cached_rows(range(loop.num_rows)):  # each row holds the KV a prefill of its tokens gives
        reference.generator.reset()
        reference.generator.append_tokens(loop.cache.tokens(r))
        np.testing.assert_allclose(loop.rows.engine.kv.valid_block(r), reference.engine.kv.valid_block(0),
                                   rtol=1e-4, atol=1e-4)
    again = _answer(loop, prompts)
    for (cached, tokens), ids, want in zip(again, prompts, cold):
        assert cached >= len(ids) - 1
        assert tokens == want


def test_saving_keeps_the_newest_entries_within_the_bound_and_deletes_only_its_own(in_place_family, saved, tmp_path):
    from staticlm.runtime.generate.slots import Prefix

    directory = tmp_path / "cache"
    shutil.copytree(saved, directory)
    (directory / "notes.txt").write_text("not ours")
    model = _open(in_place_family)
    loaded = _store(model, directory).load()
    store = _store(model, directory)
    store.max_entries = 2
    store.save([Prefix(ids, lambda kv=kv: kv) for ids, kv in loaded])
    names = sorted(p.name for p in directory.iterdir())
    assert len([n for n in names if n.endswith(".slot")]) == 2 and "notes.txt" in names
    assert [ids for ids, _ in store.load()] == [ids for ids, _ in loaded[-2:]]  # the two most recent, in order


def test_a_damaged_stale_or_foreign_cache_file_is_ignored_with_one_line(in_place_family, prompts, cold, saved,
                                                                         tmp_path, tmp_path_factory, monkeypatch,
                                                                         capsys):
    import staticlm.runtime.generate.slots as slots

    directory = tmp_path / "cache"
    shutil.copytree(saved, directory)
    model = _open(in_place_family)
    by_prompt = {tuple(ids): path for path in directory.glob("*.slot")
                 for ids, _ in [slots.SlotStore._read(_store(model, directory), path)]}
    [truncated] = [p for ids, p in by_prompt.items() if list(ids[:len(prompts[0])]) == prompts[0]]
    [flipped] = [p for ids, p in by_prompt.items() if list(ids[:len(prompts[1])]) == prompts[1]]
    truncated.write_bytes(truncated.read_bytes()[:truncated.stat().st_size // 2])
    data = bytearray(flipped.read_bytes())
    data[len(data) * 3 // 4] ^= 0x40  # one bit inside the KV rows
    flipped.write_bytes(bytes(data))

    # another family: the same architecture with other weights, its file under this family's name
    other_hf = tmp_path_factory.mktemp("other_hf")
    build_tiny_hf(other_hf, seed=1)
    other_model = _open(export_in_place(other_hf, tmp_path_factory.mktemp("other") / "family"))
    other_loop = other_model.open_loop(eager=True)
    _answer(other_loop, prompts[2:])
    other_dir = tmp_path / "other_cache"
    _store(other_model, other_dir).save(other_loop.cached_prefixes())
    [foreign] = other_dir.glob("*.slot")
    shutil.copy(foreign, directory / foreign.name)
    shutil.copy(foreign, directory / f"{truncated.name[:17]}{'f' * 16}.slot")

    # a file of an older slot format
    monkeypatch.setattr(slots, "FORMAT_VERSION", 0)
    old_store = _store(model, tmp_path / "old")
    spec = model.engine.kv.spec
    old_store.save([slots.Prefix([1, 2, 3], lambda: np.zeros((spec.num_tensors, 3, spec.head_dim), spec.dtype))])
    monkeypatch.undo()
    [old] = (tmp_path / "old").glob("*.slot")
    shutil.copy(old, directory / old.name)

    capsys.readouterr()
    loaded = _store(model, directory).load()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5, err  # truncated, flipped, the foreign file twice, the old format: one line each
    assert sum("checksum" in line for line in err) == 2
    assert sum("another model" in line for line in err) == 2
    assert sum("format 0" in line for line in err) == 1
    assert all(line.startswith("staticlm: warning: ") and line.endswith("; ignored") for line in err)
    assert [ids[:len(prompts[2])] for ids, _ in loaded] == [prompts[2]]  # the one intact file of this family

    loop = model.open_loop(eager=True)
    assert loop.restore_prefixes(loaded) == 1
    again = _answer(loop, prompts)
    assert [c for c, _ in again][:2] == [0, 0] and again[2][0] >= len(prompts[2]) - 1
    assert [t for _, t in again] == cold
    assert truncated.exists() and flipped.exists()  # ignored, not deleted


def test_cache_dir_options_are_checked_before_the_model_loads(tmp_path):
    from staticlm.apps.serve.command import check_serve_options
    from staticlm.apps.serve.options import ServeOptions
    from staticlm.errors import InvalidOption

    with pytest.raises(InvalidOption, match="--no-prompt-cache"):
        check_serve_options(ServeOptions(cache_dir=tmp_path, prompt_cache=False))
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidOption, match="not a directory"):
        check_serve_options(ServeOptions(cache_dir=tmp_path / "file"))


def test_a_restarted_server_reports_the_saved_prompt_as_cached(in_place_family, tmp_path):
    import httpx
    from serve_helpers import running_server

    body = {"model": "family", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Read this: " + "zz top abd " * 12}]}
    answers = []
    for _ in range(2):
        with running_server(in_place_family, "--cache-dir", str(tmp_path / "cache")) as base:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
            answers.append((r["choices"][0]["message"]["content"], r["usage"]))
    (first, cold_usage), (second, usage) = answers
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    assert second == first


def _held_store(model, directory: Path):
    """A SlotStore whose commits wait until released (a slow disk), saying when one started."""
    import threading

    from staticlm.runtime.generate.slots import SlotStore

    class Held(SlotStore):
        def commit(self, snapshot, **kw):
            self.started.set()
            self.release.wait(60)
            return super().commit(snapshot, **kw)

    store = Held.for_engine(directory, model.engine, max_entries=model.loop.max_saved_prefixes)
    store.started, store.release = threading.Event(), threading.Event()
    return store


def test_the_writer_saves_apart_while_the_loop_steps_on_and_writes_the_rows_of_its_snapshot(in_place_family, prompts,
                                                                                          cold, tmp_path):
    from staticlm.runtime.generate.slot_writer import SlotWriter

    model, reference = _open(in_place_family), _open(in_place_family)
    loop = model.open_loop(eager=True)
    _answer(loop, prompts[:2])
    _answer(loop, prompts[2:])
    saved = [(list(p.token_ids), np.array(p.kv())) for p in loop.cached_prefixes()]
    store = _held_store(model, tmp_path)
    writer = SlotWriter(store)
    writer.save(loop.cached_prefixes())  # returns with the commit still held
    assert store.started.wait(60) and not list(tmp_path.glob("*.slot"))
    # the loop answers on while the write waits, and overwrites the rows and the lane the snapshot copied
    others = [list(reversed(ids)) for ids in prompts] + [prompts[0][1:]]
    _answer(loop, others[:2])
    _answer(loop, others[2:])
    assert not list(tmp_path.glob("*.slot"))
    store.release.set()
    assert writer.wait(60) and writer.close(timeout=60)
    loaded = _store(model, tmp_path).load()
    assert [ids for ids, _ in loaded] == [ids for ids, _ in saved]
    for (ids, kv), (_, want) in zip(loaded, saved):
        np.testing.assert_array_equal(kv, want)  # the rows as they were at save(), not after the answers since
        reference.generator.reset()
        reference.generator.append_tokens(ids)
        np.testing.assert_allclose(kv, reference.engine.kv.valid_block(0), rtol=1e-4, atol=1e-4)


def test_closing_the_writer_writes_what_is_queued_or_abandons_it_leaving_whole_files_only(in_place_family, saved,
                                                                                         tmp_path, monkeypatch):
    import threading

    import staticlm.runtime.generate.slots as slots
    from staticlm.runtime.generate.slot_writer import SlotWriter

    model = _open(in_place_family)
    prefixes = [slots.Prefix(ids, lambda kv=kv: kv) for ids, kv in _store(model, saved).load()]
    flushed = tmp_path / "flushed"
    writer = SlotWriter(_store(model, flushed))
    writer.save(prefixes[:1])
    writer.save(prefixes)  # replaces the first snapshot if it still waits
    assert writer.close(timeout=60)
    assert sorted(p.name for p in flushed.iterdir()) == sorted(p.name for p in saved.glob("*.slot"))
    assert [ids for ids, _ in _store(model, flushed).load()] == [p.token_ids for p in prefixes]
    writer.save(prefixes[:1])  # after close: ignored
    assert len(list(flushed.iterdir())) == 3

    # a disk that stalls mid-file: close() gives up, the temp file goes, no .slot file is left half written
    monkeypatch.setattr(slots, "CHUNK_BYTES", 4096)
    stalled, warnings, writing, temp_files = tmp_path / "stalled", [], threading.Event(), []
    store = _store(model, stalled, warn=warnings.append)
    write = store._write

    def stalling_write(path, tokens, kv, *, abandon):
        def stalled_check() -> bool:  # each chunk waits until the writer is told to give up
            writing.set()
            while not abandon():
                threading.Event().wait(0.01)
            temp_files.append(len(list(stalled.glob(".*.tmp"))))  # the part written so far
            return True

        return write(path, tokens, kv, abandon=stalled_check)

    store._write = stalling_write
    writer = SlotWriter(store)
    writer.save(prefixes)
    assert writing.wait(60)
    assert not writer.close(timeout=0.1)
    assert temp_files == [1] and list(stalled.iterdir()) == []
    assert len(warnings) == 1 and "abandoned" in warnings[0]


def test_a_snapshot_copies_rows_that_are_a_view_of_the_live_cache(in_place_family, saved, tmp_path):
    from staticlm.runtime.generate.slot_writer import SlotWriter
    from staticlm.runtime.generate.slots import Prefix

    model = _open(in_place_family)
    [(ids, kv), *_] = _store(model, saved).load()
    live = np.array(kv)  # [T, n, D] a buffer the next step would overwrite
    store = _held_store(model, tmp_path)
    writer = SlotWriter(store)
    writer.save([Prefix(ids, lambda: live[:, :])])
    assert store.started.wait(60)
    live[:] = 0
    store.release.set()
    assert writer.close(timeout=60)
    [(got_ids, got)] = _store(model, tmp_path).load()
    assert got_ids == ids
    np.testing.assert_array_equal(got, kv)


def test_clients_alternating_system_prompts_hit_their_rows_and_a_restart_loads_each_row(in_place_family, tmp_path):
    """A, B, A, B through the server, each alone: the third and fourth find their system prompts in the rows, and
    --cache-dir saves each row's prefix, so a restarted server answers both from the cache with the same text."""
    import httpx
    from serve_helpers import running_server, wait_idle

    systems = {"A": "You sort apples by colour and weight. " * 4, "B": "Bikes get new spokes, then brakes. " * 4}

    def ask(base: str, who: str, turn: int) -> tuple[str, int]:
        body = {"model": "family", "max_tokens": 5, "temperature": 0, "messages": [
            {"role": "system", "content": systems[who]}, {"role": "user", "content": f"question {turn}?"}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cache = tmp_path / "cache"
    with running_server(in_place_family, "--cache-dir", str(cache)) as base:
        first = [ask(base, who, turn) for turn, who in enumerate("ABAB")]
        wait_idle(base, until=lambda h: h["cached_rows"] >= 2)
    with running_server(in_place_family, "--cache-dir", str(cache)) as base:
        again = [ask(base, who, turn) for turn, who in enumerate("ABAB")]
    num_system = min(len(s) for s in systems.values())  # the tiny tokenizer: a token a byte, at least
    assert all(c < num_system for _, c in first[:2]) and all(c >= num_system for _, c in first[2:])
    assert len(list(cache.glob("*.slot"))) >= 2
    assert all(c >= num_system for _, c in again)
    assert [t for t, _ in again] == [t for t, _ in first]
