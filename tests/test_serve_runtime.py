"""The serving runtime without HTTP: the row scheduler and the prompt cache (bookkeeping), the kv_manager's row
operations (against a naive reference), and the generation loop against the one-sequence Generator."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.errors import InvalidOption
from staticlm.kv_manager import KVSpec, Overflow, Strategy, make_kv_cache
from staticlm.runtime.generate.prompt_cache import PromptCache
from staticlm.runtime.generate.scheduler import QueueFull, RowScheduler


# -- bookkeeping ----------------------------------------------------------------------------------------------
def test_scheduler_admits_oldest_first_bounds_the_queue_and_counts_reserved_rows():
    s = RowScheduler(num_rows=4, max_queue=1)
    s.submit("a", num_rows=3)
    s.submit("b", num_rows=1)  # a and b both start at the next boundary: nobody waits yet
    s.submit("c", num_rows=2)  # waits (the one request the queue holds)
    with pytest.raises(QueueFull):
        s.submit("d", num_rows=1)
    with pytest.raises(InvalidOption):
        s.submit("e", num_rows=5)
    assert s.admissible() == [("a", 3), ("b", 1)] and s.num_free == 0
    for row, name in zip(s.free_rows(), "aaab"):
        s.occupy(row, name)
    assert s.admissible() == [] and s.num_busy == 4
    s.release(0)
    assert s.admissible() == []  # c needs 2: it blocks, nothing behind it jumps ahead
    s.release(1)
    assert s.admissible() == [("c", 2)] and s.num_waiting == 0
    s.unreserve(2)
    assert s.num_free == 2
    s.submit("f", num_rows=1)
    assert s.drop_waiting("f") and s.num_waiting == 0


def test_scheduler_admits_only_what_accepts_takes_and_at_most_max_requests():
    # rows that read one prompt segment take only the requests that extend it, oldest first (admission.py)
    from staticlm.runtime.generate.admission import extends, shared_prefix

    s = RowScheduler(num_rows=4, max_queue=8)
    for name in ("ab", "ac", "xy", "ad"):
        s.submit(name, num_rows=1)
    assert s.admissible(max_requests=1) == [("ab", 1)]
    assert s.admissible(accepts=lambda r: r.startswith("a")) == [("ac", 1)]  # xy blocks ad behind it
    assert s.num_waiting == 2 and s.num_free == 2
    assert extends([1, 2, 3], [1, 2]) and not extends([1, 2], [1, 2]) and not extends([1, 3, 4], [1, 2])
    assert shared_prefix([1, 2, 3, 4], [1, 2, 3]) == 2 and shared_prefix([1, 2], [1, 2, 3]) == 2


def test_prompt_cache_finds_the_longest_prefix_and_evicts_least_recently_used():
    c = PromptCache(3)
    c.store(0, [1, 2, 3, 4])
    c.store(1, [1, 2, 9])
    assert c.longest([1, 2, 3, 7], rows=[0, 1, 2]) == (0, 3)
    assert c.longest([1, 2, 3, 7], rows=[1, 2]) == (1, 2)
    assert c.longest([5], rows=[0, 1, 2]) == (None, 0)
    assert c.victims(1, free=[0, 1, 2]) == [2]  # the empty row first
    assert c.victims(2, free=[0, 1]) == [0, 1]  # then the least recently used
    assert c.victims(1, free=[0, 1, 2], prompt=[1, 2, 9, 5]) == [1]  # a row the prompt repeats: overwritten
    assert c.victims(1, free=[0, 1, 2], prompt=[1, 5]) == [2]  # one it shares a token with keeps its prefix
    c.touch(0)  # row 0's prefix served a prompt: row 1 is now the least recently used
    assert c.victims(1, free=[0, 1]) == [1]
    c.forget(0)
    assert c.num_cached_rows == 1


# -- kv_manager: one row cleared and loaded while the others keep decoding ---------------------------------
ops = st.lists(st.tuples(st.sampled_from(["step", "step", "load", "clear"]), st.integers(0, 10_000)),
               min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(strategy=st.sampled_from(list(Strategy)), batch=st.integers(1, 3), ops=ops, seed=st.integers(0, 2**16))
def test_rows_cleared_and_loaded_one_at_a_time_match_a_naive_reference(strategy, batch, ops, seed):
    rng = np.random.default_rng(seed)
    heads = 2 if strategy is Strategy.IN_PLACE else 1
    spec = KVSpec(num_tensors=4, head_dim=3, dtype="float32", max_past=15, max_ar=2, max_positions=10_000,
                  batch=batch, overflow=Overflow.ERROR, heads_per_buffer=heads)
    cache = make_kv_cache(spec, strategy, bmc_r=4)
    ref: list[list[np.ndarray]] = [[] for _ in range(batch)]  # per row: committed [T, D] rows
    for op, x in ops:
        b = x % batch
        if op == "load":
            rows = rng.standard_normal((4, x % 12, 3)).astype(np.float32)  # [T, n, D]
            cache.clear(b)
            cache.load(b, rows)
            ref[b] = [rows[:, i] for i in range(rows.shape[1])]
        elif op == "clear":
            cache.clear(b)
            ref[b] = []
        else:
            room = spec.max_past - max(len(r) for r in ref)
            if room <= 0:
                continue
            ar = 1 + x % min(spec.max_ar, room)
            cache.prepare(past_len=spec.max_past, ar=ar)
            commits = rng.integers(0, ar + 1, batch)
            for seq in range(batch):
                new = rng.standard_normal((4, ar, 3)).astype(np.float32)
                for t in range(4):
                    cache.slot(t, seq, ar)[0, 0] = new[t]
                ref[seq] += [new[:, i] for i in range(commits[seq])]
            cache.advance(commits)
        cache.prepare(past_len=spec.max_past, ar=1)
        for seq in range(batch):
            assert int(cache.lengths[seq]) == len(ref[seq]) == int(cache.positions[seq])
            want = np.stack(ref[seq], axis=1) if ref[seq] else np.zeros((4, 0, 3), np.float32)  # [T, n, D]
            np.testing.assert_array_equal(cache.valid_block(seq), want)


# -- the generation loop ----------------------------------------------------------------------------------------
def _open(family: Path):
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    return Model.open(family, RunOptions(device="cpu", num_threads=THREADS))


@pytest.mark.parametrize("layout", ["windows", "in_place"])
def test_requests_joining_at_different_steps_decode_as_they_would_alone(layout, tiny_chat_family, in_place_family):
    from staticlm.runtime.generate.sequence_request import Admitted, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams

    family = tiny_chat_family if layout == "windows" else in_place_family
    reference, served = _open(family), _open(family)
    tok = reference.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in
               ("abcabc abc", "The cat", "abcabc abd", "zz top", "abcabc abc", "q", "The cat sat")]
    params = [GenerationParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    want = []
    for ids, p in zip(prompts, params):
        reference.generator.reset()
        want.append(reference.generate(ids, p).token_ids)
    loop = served.open_loop(max_queue=8, eager=True)
    events: list[list] = [[] for _ in prompts]
    requests = [SequenceRequest(prompt_ids=ids, params=p, on_event=events[i].append)
                for i, (ids, p) in enumerate(zip(prompts, params))]
    for i, request in enumerate(requests):  # one joins every other step, while the others decode
        loop.submit(request)
        loop.step()
        loop.step()
        if i == 0:  # alone, it decoded on the one-sequence graphs; the next one moves it into its batch row
            assert loop.rows.engine.counters.num_decode_steps == 0 and loop.num_steps == 2
    requests[5].cancel()  # a cancelled request frees its row at the next step
    while loop.step():
        pass
    for i, evs in enumerate(events):
        [done] = [e for e in evs if isinstance(e, Finished)]
        if i == 5:
            assert done.reason is FinishReason.CANCELLED and list(done.token_ids) == want[5][:len(done.token_ids)]
        else:
            assert list(done.token_ids) == want[i], i
    cached = [next(e for e in evs if isinstance(e, Admitted)).num_cached_tokens for evs in events]
    # "abcabc abc" again: its whole prompt but the last token was in a free row (or the prefill engine)
    assert cached[4] == len(prompts[4]) - 1 and cached[2] >= len(tok.encode("abcabc ab", add_special_tokens=False))
    assert loop.status()["rows_in_use"] == 0 and loop.status()["prompt_cache_hits"] >= 2


def test_a_request_that_breaks_fails_alone_and_the_others_finish(tiny_chat_family):
    from staticlm.runtime.generate.sequence_request import Failed, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    class Breaks:  # a constraint that allows anything, then fails on its third token
        num = 0

        def allowed(self, vocab_size):
            return None

        def consume(self, token_id):
            self.num += 1
            if self.num == 3:
                raise RuntimeError("grammar broke")

    reference, served = _open(tiny_chat_family), _open(tiny_chat_family)
    ids = reference.tokenizer.encode("The cat", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    want = reference.generate(ids, params).token_ids
    loop = served.open_loop()
    good, bad = [], []
    loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=good.append))
    loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=bad.append, num_choices=2,
                                   constraint=Breaks))
    while loop.step():
        pass
    assert [type(e) for e in bad if isinstance(e, (Failed, Finished))] == [Failed]
    assert list(next(e for e in good if isinstance(e, Finished)).token_ids) == want
    assert loop.status()["rows_in_use"] == 0
    loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=good.append, num_choices=4))
    while loop.step():  # every row can be taken again
        pass
    assert [list(e.token_ids) for e in good if isinstance(e, Finished)] == [want] * 5


def test_a_bug_is_a_bare_500_for_the_client_and_a_traceback_on_the_servers_stderr(capsys):
    from staticlm.apps.serve.errors import api_error
    from staticlm.errors import UserError

    try:
        {}["missing"]
    except KeyError as e:
        error = api_error(e)
    assert error.status == 500 and "missing" not in error.body()["error"]["message"]
    assert "Traceback" in capsys.readouterr().err
    assert api_error(UserError("bad input")).status == 400 and "Traceback" not in capsys.readouterr().err


def test_a_long_prompt_is_prefilled_a_few_chunks_per_step_while_the_other_rows_decode(in_place_family):
    from staticlm.runtime.generate.sequence_request import Admitted, Delta, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    reference, served = _open(in_place_family), _open(in_place_family)
    tok = reference.tokenizer
    short = tok.encode("The cat", add_special_tokens=False)
    long = tok.encode("abcabc abd zz top " * 24, add_special_tokens=False)  # several steps' 16-row chunks
    loop = served.open_loop(eager=True)
    assert len(long) > 4 * loop.max_prefill_tokens
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    want_short, want_long = reference.generate(short, params).token_ids, reference.generate(long, params).token_ids
    decoding: list = []
    admitting: list = []
    loop.submit(SequenceRequest(prompt_ids=short, params=params, on_event=decoding.append))
    loop.step()
    loop.step()
    loop.submit(SequenceRequest(prompt_ids=long, params=params, on_event=admitting.append))
    tokens_per_step = []
    while not any(isinstance(e, Admitted) for e in admitting) or loop.status()["admitting"]:
        before = sum(len(e.token_ids) for e in decoding if isinstance(e, Delta))
        loop.step()
        tokens_per_step.append(sum(len(e.token_ids) for e in decoding if isinstance(e, Delta)) - before)
    # the long prompt took several steps, and the decoding row gained a token (two, a guess accepted) at each
    assert len(tokens_per_step) >= len(long) // loop.max_prefill_tokens - 1
    assert all(n >= 1 for n in tokens_per_step), tokens_per_step
    while loop.step():
        pass
    assert list(next(e for e in decoding if isinstance(e, Finished)).token_ids) == want_short
    assert list(next(e for e in admitting if isinstance(e, Finished)).token_ids) == want_long


def test_short_prompts_admitted_beside_a_long_one_are_prefilled_first_with_the_same_answers(in_place_family):
    # admission.py's order (scheduler.next_prefill): the long prompt, though oldest, waits for the short ones
    from staticlm.runtime.generate.sequence_request import Admitted, Delta, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    reference, served = _open(in_place_family), _open(in_place_family)
    tok = reference.tokenizer
    long = tok.encode("abcabc abd zz top " * 24, add_special_tokens=False)
    shorts = [tok.encode(text, add_special_tokens=False) for text in ("The cat", "A dog ran")]
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    want = [reference.generate(ids, params).token_ids for ids in (long, *shorts)]
    loop = served.open_loop(eager=True)
    events: list[list] = [[], [], []]
    for ids, out in zip((long, *shorts), events):
        loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=out.append))
    while loop.step():
        pass
    admitted = [next(e.time for e in out if isinstance(e, Admitted)) for out in events]
    first = [next(e.time for e in out if isinstance(e, Delta)) for out in events]
    assert admitted[1] < admitted[2] < admitted[0] and max(first[1:]) < first[0]
    assert [list(next(e for e in out if isinstance(e, Finished)).token_ids) for out in events] == want


@pytest.mark.parametrize("beside", [False, True])
def test_a_short_prompt_that_comes_while_a_long_one_prefills_goes_first_and_the_long_one_resumes(beside,
                                                                                                   in_place_family):
    # admission.py: the long prompt's rows so far wait in a free row and come back; none is prefilled twice.
    # beside: a row decodes meanwhile (a served load), not only the lane prefilling alone
    from staticlm.runtime.generate.sequence_request import Delta, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    reference, served = _open(in_place_family), _open(in_place_family)
    tok = reference.tokenizer
    long = tok.encode("abcabc abd zz top " * 24, add_special_tokens=False)
    short = tok.encode("The cat", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    want = [reference.generate(ids, params).token_ids for ids in (long, short)]
    loop = served.open_loop(eager=True)
    assert len(long) > 2 * loop.max_prefill_tokens
    prefilled: list[int] = []
    append = served.generator.append_tokens
    served.generator.append_tokens = lambda ids: (prefilled.append(len(ids)), append(ids))[1]
    events: list[list] = [[], [], []]
    if beside:
        other = tok.encode("Hello", add_special_tokens=False)  # no prefix shared with the two prompts
        assert other[0] not in (long[0], short[0])
        loop.submit(SequenceRequest(prompt_ids=other, params=GenerationParams(max_new_tokens=60, ignore_eos=True),
                                    on_event=events[2].append))
        loop.step()
        prefilled.clear()
        assert loop.status()["rows_in_use"] == 1
    loop.submit(SequenceRequest(prompt_ids=long, params=params, on_event=events[0].append))
    loop.step()  # the long prompt's first chunk
    assert prefilled == [loop.max_prefill_tokens]
    loop.submit(SequenceRequest(prompt_ids=short, params=params, on_event=events[1].append))
    while loop.step():
        pass
    first = [next(e.time for e in out if isinstance(e, Delta)) for out in events[:2]]
    assert first[1] < first[0]
    assert sum(prefilled) == len(long) + len(short)  # the long one went on from where it was set aside
    assert [list(next(e for e in out if isinstance(e, Finished)).token_ids) for out in events[:2]] == want


def test_logprobs_and_grammars_run_on_the_single_path(in_place_family):
    # a single `generate` is a caller of the same loop as the server: what a request may ask, it may ask here
    from staticlm.runtime.generate.text_stream import GenerationParams

    model = _open(in_place_family)
    ids = model.tokenizer.encode("The cat", add_special_tokens=False)
    allowed_ids = sorted(set(model.tokenizer.encode("abc", add_special_tokens=False)))

    class OnlyAbc:
        def allowed(self, vocab_size):
            mask = np.zeros(vocab_size, bool)
            mask[allowed_ids] = True
            return mask

        def consume(self, token_id):
            assert token_id in allowed_ids

    result = model.generate(ids, GenerationParams(max_new_tokens=12, ignore_eos=True), constraint=OnlyAbc)
    assert len(result.token_ids) == 12 and set(result.token_ids) <= set(allowed_ids)
    assert set(result.text) <= set("abc")
    greedy = model.generate(ids, GenerationParams(max_new_tokens=6, ignore_eos=True), num_logprobs=3)
    assert [lp.token_id for lp in greedy.logprobs] == greedy.token_ids
    for lp in greedy.logprobs:  # greedy: the chosen token is the likeliest, and logprobs are log-probabilities
        assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_a_decode_step_checks_a_looked_up_guess_in_the_row_beside_its_token(in_place_family):
    # The paired row (Engine.pairs_rows) is not wasted: where prompt lookup has a guess, the step verifies it.
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    paired, lone = _open(in_place_family), Model.open(in_place_family, RunOptions(device="cpu", num_threads=THREADS,
                                                                                  lone_rows=True))
    assert paired.engine.pairs_rows and not lone.engine.pairs_rows and lone.generator.speculator is None
    ids = paired.tokenizer.encode("abcabcabcabc abcabc", add_special_tokens=False)  # repeats: lookup finds guesses
    params = GenerationParams(max_new_tokens=30, ignore_eos=True)
    plain = _open(in_place_family)
    plain.generator.speculator = None  # every step recomputes the row before its token instead
    want = plain.generate(ids, params).token_ids
    assert paired.generate(ids, params).token_ids == want
    stats = paired.generator.speculator.stats
    assert stats.num_accepted > 0 and stats.num_drafted <= stats.num_steps  # one guess a step at most
    assert paired.engine.counters.num_verify_rows == 2 * paired.engine.counters.num_verify_steps  # exactly 2 rows


def test_clients_alternating_system_prompts_each_find_theirs_in_a_row_with_the_cold_answers(in_place_family):
    """Two clients take turns (A, B, A, B, A, B), each request alone: their system prompts share only a short
    header (a chat template's), and each finds its own in a row of the prompt cache."""
    from staticlm.runtime.generate.sequence_request import Admitted, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    reference, served = _open(in_place_family), _open(in_place_family)
    tok = reference.tokenizer
    header = "<system> "
    systems = [header + "You sort apples by colour and weight. " * 4,
               header + "Bikes get new spokes, then brakes. " * 4]
    turns = [(k % 2, f"{systems[k % 2]}<user> question {k}?") for k in range(6)]
    params = GenerationParams(max_new_tokens=6, ignore_eos=True)
    loop = served.open_loop(eager=True)
    for k, (who, text) in enumerate(turns):
        ids = tok.encode(text, add_special_tokens=False)
        reference.generator.reset()
        want = reference.generate(ids, params).token_ids
        events: list = []
        loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=events.append))
        while loop.step():
            pass
        [admitted] = [e for e in events if isinstance(e, Admitted)]
        [done] = [e for e in events if isinstance(e, Finished)]
        assert list(done.token_ids) == want, k
        num_system = len(tok.encode(systems[who], add_special_tokens=False))
        assert admitted.num_cached_tokens >= (num_system if k >= 2 else 0), k
    assert loop.status()["cached_rows"] == 2  # a row per client: a turn overwrites the row its prompt repeats
    assert loop.status()["rows_in_use"] == 0


@pytest.mark.skipif(not __import__("staticlm.runtime.kernels", fromlist=["x"]).available(),
                    reason="idle rows are skipped by staticlm's attention op, whose kernels are not built here")
def test_an_idle_row_holding_a_cached_prefix_is_neither_read_nor_written_by_a_decode_step(tiny_hf_dir, tmp_path):
    """The prompt cache keeps a prefix in each free row: a batch step of the other rows must not attend over it
    (its KV is poisoned here: reading it would make that row's logits NaN) nor write into its buffer."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    family = tmp_path / "family"
    export_cpu_family(load_model(tiny_hf_dir), family, cpu=CpuOptions(staticlm_attention=True),
                      options=ExportOptions(contexts=(128,), prefill_len=16, verify_lens=(4,), batch_sizes=(4,)))
    model = _open(family)
    loop = model.open_loop(eager=True)
    rows, lane = loop.rows.engine, loop.lane
    tok = model.tokenizer
    active, tokens = np.array([True, False, False, False]), np.full(4, tok.encode("a")[0], np.int64)
    lane.append_tokens(tok.encode("The cat sat on the mat and looked around", add_special_tokens=False))
    for r in (1, 2, 3):  # a cached prefix in each idle row, its rows poisoned
        rows.load_row(r, lane.engine)
    for buffer in rows.kv.buffers():
        buffer[1:] = np.nan
    before = [b.copy() for b in rows.kv.buffers()]
    lane.reset()
    lane.append_tokens(tok.encode("zz top", add_special_tokens=False))
    rows.load_row(0, lane.engine)
    want = [lane.engine.decode(int(tokens[0]))]  # the active row alone, on the lane
    got = [rows.decode_batch(tokens, active=active)]
    assert np.isfinite(got[0]).all()  # the idle rows' attention read nothing (their outputs are zeros)
    np.testing.assert_allclose(got[0][0], want[0], rtol=1e-4, atol=1e-4)
    for b, a in zip(rows.kv.buffers(), before):
        np.testing.assert_array_equal(b[1:], a[1:])  # nothing written into an idle row (NaN == NaN here)
