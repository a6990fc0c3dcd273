"""Speculative decoding: greedy output identical to plain greedy; sampling matches the target's distribution."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from reference import hf_greedy
from staticlm.apps.common import open_tokenizer
from staticlm.runtime.device import Device, DeviceOptions
from staticlm.runtime.drafters import DraftModelDrafter, PromptLookupDrafter
from staticlm.runtime.engine import Engine, EngineOptions
from staticlm.runtime.generator import GenerationParams, Generator
from staticlm.runtime.sampling import SamplingParams
from staticlm.runtime.speculative import DraftLength, Speculator

CPU = EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=2))
REWRITE = ("Copy this sentence exactly, then copy it again: the quick brown fox jumps over the lazy dog "
           "while the quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def tiny_draft_family(tiny_hf_dir, tmp_path_factory):
    """The tiny model's first layer: same tokenizer, a different (worse) distribution."""
    from staticlm.export.draft import truncate_layers
    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    out = tmp_path_factory.mktemp("tiny_draft") / "family"
    export_family(truncate_layers(load_model(tiny_hf_dir), 1), out,
                  options=ExportOptions(contexts=(256, 512), prefill_len=16, verify_lens=(4, 8)))
    return out


def generator(family, speculator=None) -> Generator:
    gen = Generator(Engine(family, options=CPU), open_tokenizer(family))
    gen.speculator = speculator
    return gen


def test_draft_length_follows_bass_algorithm_1():
    policy = DraftLength()
    assert policy.current == 7
    policy.update(7)
    assert policy.current == 9  # all accepted: + l_incre
    policy.update(2)
    assert policy.current == 9 - 1  # first decrease: - ceil(9 / 10)
    policy.update(0)
    assert policy.current == 8 - 1 - 1  # consecutive decrease also subtracts s = 1
    policy.update(5)
    assert policy.current == 5  # 6 - 1 - 1 = 4, but never below the accepted count
    for _ in range(20):
        policy.update(policy.current)
    assert policy.current == 32  # l_limit
    fixed = DraftLength(initial=4, fixed=True)
    fixed.update(0)
    assert fixed.current == 4


def test_prompt_lookup_copies_what_followed_the_last_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    rng = np.random.default_rng(0)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6]
    assert drafter.propose(context, 3, params=SamplingParams(), rng=rng)[0] == [7, 2, 3]  # the latest "5 6"
    assert drafter.propose([1, 2, 3], 3, params=SamplingParams(), rng=rng)[0] == []


def test_tiny_greedy_lookup_and_draft_model_equal_transformers(tiny_chat_family, tiny_draft_family, tiny_hf_model):
    prompt = open_tokenizer(tiny_chat_family).encode("abcabcabcabc abcabc", add_special_tokens=False)
    want = hf_greedy(tiny_hf_model, prompt, 40, eos=None)
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    lookup = Speculator(PromptLookupDrafter())
    draft = Speculator(DraftModelDrafter(Engine(tiny_draft_family, options=CPU), open_tokenizer(tiny_draft_family)))
    for speculator in (lookup, draft):
        gen = generator(tiny_chat_family, speculator)
        assert gen.generate(prompt, params).token_ids == want
        assert speculator.stats.num_steps > 0 and speculator.stats.num_drafted > 0
        assert gen.engine.kv.stats.copied_bytes == 0  # rejected rows are never copied or cleared


def _target_joint(model, prompt: list[int], *, top_k: int, depth: int,
                  temperature: float) -> dict[tuple[int, ...], float]:
    """P(t1..t_depth) under top-k sampling at a temperature, straight from transformers."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double().numpy() / temperature
            top = np.argsort(-logits)[:top_k]
            probs = np.exp(logits[top] - logits[top].max())
            probs /= probs.sum()
            for token, p in zip(top.tolist(), probs):
                nxt[prefix + (token,)] = mass * p
        joint = nxt
    return joint


def test_tiny_speculative_sampling_matches_the_target_distribution(tiny_chat_family, tiny_draft_family,
                                                                    tiny_hf_model):
    prompt = open_tokenizer(tiny_chat_family).encode("hello", add_special_tokens=False)
    # The tiny model is sharp (its embedding is scaled up): a high temperature spreads the mass over many cells.
    top_k, depth, num_samples, temperature = 3, 3, 3000, 6.0
    expected = _target_joint(tiny_hf_model, prompt, top_k=top_k, depth=depth, temperature=temperature)
    speculator = Speculator(DraftModelDrafter(Engine(tiny_draft_family, options=CPU),
                                              open_tokenizer(tiny_draft_family)),
                            length=DraftLength(initial=3, fixed=True))
    gen = generator(tiny_chat_family, speculator)
    gen.seed(7)
    params = GenerationParams(max_new_tokens=depth, ignore_eos=True,
                              sampling=SamplingParams(temperature=temperature, top_k=top_k))
    counts = dict.fromkeys(expected, 0)
    for _ in range(num_samples):
        counts[tuple(gen.generate(prompt, params).token_ids)] += 1  # a KeyError would be an impossible sequence
    assert speculator.stats.num_drafted > 0 and 0 < speculator.stats.num_accepted < speculator.stats.num_drafted
    cells = [c for c in expected if expected[c] * num_samples >= 5]  # chi-square needs expected counts >= 5
    observed = np.array([counts[c] for c in cells], float)
    wanted = np.array([expected[c] for c in cells]) * num_samples
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(cells) - 1
    assert dof >= 8, f"only {len(cells)} cells: the test would have no power"
    # Wilson-Hilferty: the 1% upper point of chi-square(dof), so the test fails only if p < 0.01.
    z = 2.326
    critical = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, f"chi2 {chi2:.1f} over {dof} dof (critical {critical:.1f})"


@pytest.mark.slow
def test_smollm2_greedy_lookup_identical_and_fewer_steps(smollm2_family):
    tokenizer = open_tokenizer(smollm2_family)
    from staticlm.runtime.chat_template import render_chat
    from staticlm.export.manifest import load_manifest

    template = load_manifest(smollm2_family).chat_template
    ids = tokenizer.encode(render_chat(template, [{"role": "user", "content": REWRITE}], add_generation_prompt=True),
                           add_special_tokens=False)
    params = GenerationParams(max_new_tokens=48, ignore_eos=True)
    plain = generator(smollm2_family).generate(ids, params).token_ids
    speculator = Speculator(PromptLookupDrafter())
    gen = generator(smollm2_family, speculator)
    assert gen.generate(ids, params).token_ids == plain
    assert speculator.stats.num_accepted > 0
    assert speculator.stats.num_steps + (48 - speculator.stats.num_accepted - speculator.stats.num_steps) < 48
