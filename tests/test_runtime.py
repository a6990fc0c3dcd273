"""The runtime end to end: golden greedy output against transformers, zero copy, multi-turn KV reuse."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from conftest import THREADS, model_of
from reference import hf_greedy

from staticlm.kv_manager import Strategy
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.model import Model, open_tokenizer
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device, DeviceOptions

CPU = DeviceOptions(device=Device.CPU, num_threads=THREADS)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
WINDOW_STRATEGIES = [s for s in Strategy if s is not Strategy.IN_PLACE]  # in_place needs GQA graphs (test_cpu_target)
STRATEGY_CASES = [(s, 2.0) for s in WINDOW_STRATEGIES] + [(Strategy.POINTER, 1.5), (Strategy.SHIFT, 1.5)]
# SmolLM2 runs each strategy once (pointer at 2.0 is the default every other SmolLM2 test runs), and pointer at 1.5,
# where the answer fills the buffer and compacts; the tiny model runs every case.
SMOLLM2_STRATEGY_CASES = [(s, 2.0) for s in WINDOW_STRATEGIES if s is not Strategy.POINTER] + [(Strategy.POINTER, 1.5)]
_HF_ANSWERS: dict[tuple, list[int]] = {}  # transformers' greedy answers, computed once per prompt


def hf_answer(model, ids: list[int], num_new: int) -> list[int]:
    key = (id(model), tuple(ids), num_new)
    if key not in _HF_ANSWERS:
        _HF_ANSWERS[key] = hf_greedy(model, ids, num_new, eos=None)
    return _HF_ANSWERS[key]


def open_chat(engine):
    """A chat over an engine the test built itself, through the one way a model is opened."""
    return Model(engine, options=RunOptions(model_dir=engine.model_dir)).chat()


def engine_for(family, *, strategy=Strategy.POINTER, reserve=2.0, device=CPU) -> Engine:
    return Engine(family, options=EngineOptions(device=device, kv_strategy=strategy, kv_reserve=reserve))


def greedy(family, prompt_ids, num_new, **kw) -> tuple[list[int], Engine]:
    engine = engine_for(family, **kw)
    result = model_of(engine).generate(list(prompt_ids), GenerationParams(max_new_tokens=num_new, ignore_eos=True))
    return result.token_ids, engine


def plain_ids(family, text: str) -> list[int]:
    """The tiny model's contexts are too short for a chat template: one byte per token."""
    return open_tokenizer(family).encode(text, add_special_tokens=False)


def chat_ids(family, text: str) -> list[int]:
    session = open_chat(engine_for(family))
    from staticlm.runtime.text.chat_template import Message

    return session.prompt_ids([Message(role="user", content=text)])


# -- tiny model: every path, fast -------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,reserve", STRATEGY_CASES)
def test_tiny_greedy_matches_transformers_on_every_kv_strategy(tiny_family, tiny_hf_model, strategy, reserve):
    prompt = plain_ids(tiny_family, "hello there, tiny model")
    num_new = 63 - len(prompt)  # fill the largest window: the ladder climbs and reserve 1.5 compacts
    want = hf_greedy(tiny_hf_model, prompt, num_new, eos=None)
    got, engine = greedy(tiny_family, prompt, num_new, strategy=strategy, reserve=reserve)
    assert got == want
    if strategy is Strategy.POINTER and reserve == 1.5:
        assert engine.kv.stats.num_compactions >= 1


def test_tiny_zero_copy_bindings_are_the_buffers_own(tiny_family):
    engine = engine_for(tiny_family)
    model_of(engine).generate(plain_ids(tiny_family, "hi"), GenerationParams(max_new_tokens=20, ignore_eos=True))
    assert engine.kv.stats.copied_bytes == 0 and engine.kv.stats.num_compactions == 0
    runner = engine.runner(engine.graphs.rung(engine.graphs.decode, engine.num_cached - 1))
    p = runner.shape.past_len
    windows = np.array([[engine.kv.window(t, 0, p).ctypes.data] for t in range(engine.kv.spec.num_tensors)])
    slots = np.array([[engine.kv.slot(t, 0, 1).ctypes.data] for t in range(engine.kv.spec.num_tensors)])
    # the last step bound the windows one row before the current end: the addresses are the buffer's own rows
    row = engine.config.head_dim * np.dtype(engine.manifest.kv_dtype).itemsize
    assert np.array_equal(runner.bound_kv_inputs, windows - row)
    assert np.array_equal(runner.bound_kv_outputs, slots - row)


def test_tiny_second_turn_equals_fresh_prefill(tiny_chat_family):
    params = GenerationParams(max_new_tokens=8, ignore_eos=True)
    session = open_chat(engine_for(tiny_chat_family))
    list(session.send("first question", params))
    first_total = session.num_context_tokens
    answer2 = "".join(session.send("second one", params))
    assert session.last_result.prompt_tokens < first_total  # only the new turn was prefilled
    fresh = open_chat(engine_for(tiny_chat_family))
    fresh.messages = session.messages[:-1]
    assert "".join(fresh._answer(fresh.messages, params, lambda: False)) == answer2
    assert fresh.last_result.token_ids == session.last_result.token_ids


def test_htp_on_a_family_it_cannot_run_is_refused_before_any_session(tiny_family):
    """A float (or int4 CPU, or KV-only) family runs in fp16 on HTP, where an LLM's activations overflow: refused
    in one line before a session (or a compiled context) exists. HTP runs QDQ families: tests/test_htp.py."""
    proc = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(tiny_family),
                           "--prompt", "hi", "--device", "htp"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "--device htp runs an HTP family (staticlm export --target htp)" in line and "float family" in line
    assert not (tiny_family / ".qnn_cache").exists()


def test_auto_device_picks_htp_only_for_a_family_htp_runs(tiny_family, monkeypatch):
    from staticlm.runtime.family.manifest import load_manifest
    from staticlm.runtime.session import device

    float_family = load_manifest(tiny_family)
    htp_family = dataclasses.replace(float_family, quantization={"quant": "w8a16"})
    for npu in (False, True):
        monkeypatch.setattr(device, "npu_available", lambda npu=npu: npu)
        assert device.resolve_device(Device.AUTO, family=float_family, model_dir=tiny_family) is Device.CPU
        assert device.resolve_device(Device.AUTO, family=htp_family, model_dir=tiny_family) is \
            (Device.HTP if npu else Device.CPU)
    assert device.resolve_device(Device.HTP, family=htp_family, model_dir=tiny_family) is Device.HTP


# -- SmolLM2: the real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2_family, smollm2_hf_model):
    for prompt in PROMPTS:
        ids = chat_ids(smollm2_family, prompt)
        want = hf_answer(smollm2_hf_model, ids, 64)
        got, engine = greedy(smollm2_family, ids, 64)
        assert got == want, prompt
        assert engine.kv.stats.copied_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy,reserve", SMOLLM2_STRATEGY_CASES)
def test_smollm2_identical_across_kv_strategies(smollm2_small_family, smollm2_hf_model, strategy, reserve):
    ids = chat_ids(smollm2_small_family, PROMPTS[0])
    want = hf_answer(smollm2_hf_model, ids, 64)
    got, engine = greedy(smollm2_small_family, ids, 64, strategy=strategy, reserve=reserve)
    assert got == want
    if strategy is Strategy.POINTER and reserve == 1.5:
        assert engine.kv.stats.num_compactions >= 1


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_family):
    session = open_chat(engine_for(smollm2_family))
    text = "".join(session.send("What is the capital of France?", GenerationParams(max_new_tokens=32)))
    assert "Paris" in text


# -- batches: several sequences, ragged, one call per step ---------------------------------------------------
def test_tiny_batched_decode_with_ragged_sequences_matches_transformers(tiny_chat_family, tiny_hf_model, rng):
    import torch

    prompt = plain_ids(tiny_chat_family, "shared prompt")
    single = engine_for(tiny_chat_family)
    single.prefill(prompt)
    batch = Engine(tiny_chat_family, options=single.options, batch=4, weights_from=single)
    batch.load_prefix(single)
    # Each sequence gets its own tokens; sequence 2 pauses (masked) on odd steps, so lengths are ragged.
    streams = [rng.integers(0, 256, 12).tolist() for _ in range(4)]
    fed = [[] for _ in range(4)]
    for step in range(12):
        active = np.array([not (seq == 2 and step % 2) for seq in range(4)])
        tokens = np.array([streams[seq][len(fed[seq])] for seq in range(4)])
        logits = batch.decode_batch(tokens, active=active).copy()
        for seq in np.flatnonzero(active):
            fed[seq].append(int(tokens[seq]))
            with torch.no_grad():
                want = tiny_hf_model(torch.tensor([prompt + fed[seq]])).logits[0, -1].numpy()
            np.testing.assert_allclose(logits[seq], want, atol=1e-3, err_msg=f"sequence {seq} step {step}")
    assert list(batch.kv.lengths) == [len(prompt) + len(f) for f in fed]
    assert batch.kv.lengths[2] < batch.kv.lengths[0]  # ragged
    # one copy of the prompt per sequence at the start, nothing per token
    bytes_per_row = batch.kv.spec.num_tensors * batch.kv.spec.head_dim * 4
    assert batch.kv.stats.copied_bytes == 4 * len(prompt) * bytes_per_row


def test_tiny_num_responses_cli(tiny_chat_family):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(tiny_chat_family),
                          "--prompt", "hi", "--num-responses", "4", "--max-new-tokens", "6", "--ignore-eos",
                          "--temperature", "1.0", "--top-p", "1.0", "--min-p", "0", "--seed", "3", "--json",
                          "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert [len(r["token_ids"]) for r in summary["responses"]] == [6] * 4
    # sampled independently (the whole distribution: the tiny model's mass is mostly on one token, which the default
    # top-p and min-p would keep alone)
    assert len({tuple(r["token_ids"]) for r in summary["responses"]}) > 1
    assert summary["new_tokens"] == 24 and summary["total_tok_s"] > 0


def test_verify_graphs_open_only_when_speculation_will_run(tiny_family):
    """Each CPU session may hold its own prepacked weights: a graph nobody runs is not opened at warm-up."""
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    def opened_verify_files(options: RunOptions) -> set[str]:
        engine = Model.open(tiny_family, options).engine
        verify_files = {engine.model_dir / g.file for ladder in engine.graphs.verify.values() for g in ladder}
        opened = (engine.graphs.decode[0], *engine.graphs.prefill[:1])  # open anyway
        verify_files -= {engine.model_dir / g.file for g in opened}
        assert verify_files  # the tiny family has verify-only graphs
        return verify_files & engine.sessions.files

    assert opened_verify_files(RunOptions()) == set()
    assert opened_verify_files(RunOptions(speculate="lookup"))
