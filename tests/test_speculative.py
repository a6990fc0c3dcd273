"""Speculative decoding: greedy output identical to plain greedy; sampling matches the target's distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import THREADS, model_of
from reference import hf_greedy

from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.model import open_tokenizer
from staticlm.runtime.session.device import Device, DeviceOptions
from staticlm.runtime.speculative.drafters import DraftModelDrafter, PromptLookupDrafter
from staticlm.runtime.speculative.speculation_policy import DraftLength, SpeculationPolicy
from staticlm.runtime.speculative.speculative import Speculator

CPU = EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS))
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


def generator(family, speculator=None):
    """A model over the family whose one-sequence answers use speculator (None: plain decoding)."""
    return model_of(Engine(family, options=CPU), speculator=speculator)


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


def test_draft_length_maps_onto_the_exported_verify_graphs():
    from staticlm.runtime.speculative.speculation_policy import fit_to_verify_graphs

    lens = (4, 8, 16)
    assert [fit_to_verify_graphs(n, lens) for n in (1, 2, 3, 6, 7, 9, 14, 15, 32)] == [1, 2, 3, 3, 7, 7, 7, 15, 15]
    policy = DraftLength()
    policy.update(7)  # 7 -> 9, of which the AR=8 graph takes 7
    policy.update(7, num_drafted=7)  # the whole (cut) draft accepted: still growing
    assert policy.current == 11


def test_acceptance_profile_counts_runs_and_the_length_follows_the_measured_costs():
    from staticlm.runtime.speculative.speculation_policy import AcceptanceProfile, cost_aware_length

    runs = AcceptanceProfile(decay=1.0)
    for _ in range(20):  # drafts right for a run of 7 or wrong from the first token, half the time each
        runs.record(7, 7)
        runs.record(7, 0)
    # position 0 accepted 20 of 40 times, positions 1-6 every time they were offered: 1 + 21/42 * (1 + ... )
    want = 1 + sum((21 / 42) * (21 / 22) ** j for j in range(7))
    assert abs(runs.expected_tokens(7) - want) < 1e-12
    assert runs.expected_tokens(3) < runs.expected_tokens(7) < 1 + 7

    lens = (4, 8, 16)
    cpu = {4: 1.7, 8: 2.9, 16: 5.1}.get  # verify cost in decode steps, as measured on 2 CPU cores
    npu = {4: 1.05, 8: 1.1, 16: 1.2}.get  # nearly flat: the weights are read once whatever the rows
    assert cost_aware_length(runs, max_draft=15, verify_lens=lens, cost_ratio=cpu) == 3  # 2.4/1.7 beats 4.2/2.9
    # positions never offered keep the last rate seen (BASS's optimism: a fully accepted draft grows)
    assert cost_aware_length(runs, max_draft=15, verify_lens=lens, cost_ratio=npu) == 15
    assert cost_aware_length(runs, max_draft=9, verify_lens=lens, cost_ratio=npu) == 7  # BASS's length caps it
    assert cost_aware_length(runs, max_draft=7, verify_lens=lens, cost_ratio=lambda ar: None) == 3  # time it first
    assert cost_aware_length(runs, max_draft=2, verify_lens=lens, cost_ratio=cpu) == 2  # below every graph


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
            for token, p in zip(top.tolist(), probs, strict=True):
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
    counts = dict.fromkeys(expected, 0)
    for seed in range(num_samples):  # a seed per answer: independent draws, the same ones on every run
        params = GenerationParams(max_new_tokens=depth, ignore_eos=True,
                                  sampling=SamplingParams(temperature=temperature, top_k=top_k, seed=seed))
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
    from staticlm.runtime.family.manifest import load_manifest
    from staticlm.runtime.text.chat_template import render_chat

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


class _NoiseDrafter:
    """Random drafts of random length: mostly rejected, so acceptance differs from the other sequences'."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def propose(self, context, num_tokens, *, params, rng):
        return self.rng.integers(0, 256, self.rng.integers(1, num_tokens + 1)).tolist(), None


def test_tiny_batched_speculation_with_ragged_acceptance_equals_transformers(tiny_chat_family, tiny_draft_family,
                                                                              tiny_hf_model):
    """BASS-PAD: four sequences of different lengths draft, verify in one call, accept their own counts."""
    from staticlm.runtime.speculative.batch_speculative import BatchSpeculator

    tok = open_tokenizer(tiny_chat_family)
    prompt = tok.encode("abcabcabc abcabc", add_special_tokens=False)
    tails = ["abcabc", "xyz", "q", "the cat sat on the mat, the cat"]  # ragged, and unequally predictable
    single = Engine(tiny_chat_family, options=CPU)
    single.prefill(prompt)
    batch = Engine(tiny_chat_family, options=CPU, batch=4, weights_from=single)
    batch.load_prefix(single)
    prefixes = [prompt + tok.encode(t, add_special_tokens=False) for t in tails]
    logits = np.zeros((4, batch.config.vocab_size), np.float32)
    for step in range(max(len(p) for p in prefixes) - len(prompt)):
        active = np.array([len(prompt) + step < len(p) for p in prefixes])
        fed = np.array([p[len(prompt) + step] if a else 0 for p, a in zip(prefixes, active, strict=True)])
        out = batch.decode_batch(fed, active=active)
        logits[active] = out[active]
    num_new = 24
    generated = [[int(np.argmax(logits[b]))] for b in range(4)]  # the last token of each is pending
    greedy = SamplingParams(temperature=0.0)
    draft_model = DraftModelDrafter(Engine(tiny_draft_family, options=CPU), open_tokenizer(tiny_draft_family))
    drafters = [PromptLookupDrafter(), _NoiseDrafter(1), draft_model, _NoiseDrafter(2)]
    speculator = BatchSpeculator(drafters, probe_every=1)  # always verify (no cost gate)
    rng = np.random.default_rng(0)
    ragged_steps = 0
    while True:
        active = np.array([len(g) < num_new for g in generated])
        if not active.any():
            break
        last = np.array([g[-1] for g in generated])
        contexts = [p + g for p, g in zip(prefixes, generated, strict=True)]
        fresh = speculator.step(batch, last, active=active, contexts=contexts, params=[greedy] * 4, rngs=[rng] * 4)
        if fresh is None:  # nobody had a draft: one plain batched decode step
            out = batch.decode_batch(last, active=active)
            fresh = [[int(np.argmax(out[b]))] if active[b] else [] for b in range(4)]
        ragged_steps += len({len(fresh[b]) for b in np.flatnonzero(active)}) > 1
        for b in np.flatnonzero(active):
            generated[b].extend(fresh[b])
    for b in range(4):
        assert generated[b][:num_new] == hf_greedy(tiny_hf_model, prefixes[b], num_new), f"sequence {b}"
    # Exactly the accepted rows were committed, and they hold the right K/V: the next step's logits agree.
    assert batch.kv.lengths.tolist() == [len(p) + len(g) - 1 for p, g in zip(prefixes, generated, strict=True)]
    out = batch.decode_batch(np.array([g[-1] for g in generated]), active=np.ones(4, bool))
    for b in range(4):
        with torch.no_grad():
            want = tiny_hf_model(torch.tensor([prefixes[b] + generated[b]])).logits[0, -1].numpy()
        np.testing.assert_allclose(out[b], want, atol=1e-3, err_msg=f"sequence {b}")
    assert speculator.stats.num_steps > 0 and speculator.stats.num_accepted > 0
    assert ragged_steps > 0  # sequences accepted different numbers of drafts in one call
    # one copy of the prompt per sequence at the start; rejected and padding rows were never copied
    bytes_per_row = batch.kv.spec.num_tensors * batch.kv.spec.head_dim * 4
    assert batch.kv.stats.copied_bytes == 4 * len(prompt) * bytes_per_row


class _ConstantDrafter:
    """Drafts `token` repeated, up to num_tokens times (never id 0 unless asked)."""

    def __init__(self, token: int, *, max_tokens: int = 32) -> None:
        self.token, self.max_tokens = token, max_tokens

    def propose(self, context, num_tokens, *, params, rng):
        return [self.token] * min(num_tokens, self.max_tokens), None


class _VerifyOnlyEngine:
    """What a speculator asks of an Engine, without a model: every row predicts token 5; `cost` is AR=4's cost
    in decode steps (None: not timed yet), and the rows of a longer graph cost in proportion, as on a CPU."""

    def __init__(self, *, batch: int, cost: float | None) -> None:
        self.batch, self.cost, self.verify_lens = batch, cost, (4, 8)
        self.num_verify_steps = 0

    def verify_len(self, num_tokens):
        return next((ar for ar in self.verify_lens if ar >= num_tokens), None)

    def verify_cost_ratio(self, ar):
        return None if self.cost is None else self.cost * ar / 4

    def verify(self, token_ids, *, num_real=None):
        self.num_verify_steps += 1
        logits = np.zeros((*np.shape(token_ids), 16), np.float32)
        logits[..., 5] = 1.0
        return logits

    def commit(self, num_tokens):
        pass


def test_batched_speculation_decides_with_the_per_sequence_profile():
    """One sequence's drafts always right, three always wrong: the batch's mean yield, not its best, decides."""
    from staticlm.runtime.speculative.batch_speculative import BatchSpeculator

    drafters = [_ConstantDrafter(5), _ConstantDrafter(9), _ConstantDrafter(9), _ConstantDrafter(9)]
    speculator = BatchSpeculator(drafters, length=DraftLength(initial=3), probe_every=4)
    assert isinstance(speculator.policy, SpeculationPolicy)
    assert isinstance(Speculator(PromptLookupDrafter()).policy, SpeculationPolicy)  # one policy for both paths
    engine = _VerifyOnlyEngine(batch=4, cost=None)
    greedy, rng = SamplingParams(temperature=0.0), np.random.default_rng(0)

    def step():
        return speculator.step(engine, np.array([1, 2, 3, 4]), active=np.ones(4, bool),
                               contexts=[[1], [2], [3], [4]], params=[greedy] * 4, rngs=[rng] * 4)

    assert step() == [[5, 5, 5, 5], [5], [5], [5]]  # not timed yet: verify
    profile = speculator.policy.profile
    # every sequence's outcome over the step's 3 draft rows: position 0 offered 4 times, accepted once
    assert profile.offered == [4, 1, 1] and profile.accepted == [1, 1, 1]
    assert speculator.policy.length.current == 5  # BASS on the batch's best: sequence 0 took its whole draft
    assert abs(profile.expected_tokens(3) - (1 + 2 / 6 + 2 / 6 * 2 / 3 + 2 / 6 * (2 / 3) ** 2)) < 1e-12
    # AR=4 now costs 2 decode steps; a verify step yields ~1.7 tokens a sequence (its best would yield 4): plain
    # decoding, with a probe every 4th step.
    engine.cost = 2.0
    assert [step() is None for _ in range(8)] == [True, True, True, False] * 2
    assert engine.num_verify_steps == 3 and speculator.stats.num_steps == 3
    assert speculator.policy.num_skipped == 8
    # Had the drafts all been right, the same cost would pay: the policy follows the sequences' outcomes.
    right = BatchSpeculator([_ConstantDrafter(5)] * 4, length=DraftLength(initial=3), probe_every=4)
    engine.cost = None
    right.step(engine, np.array([1, 2, 3, 4]), active=np.ones(4, bool), contexts=[[1], [2], [3], [4]],
               params=[greedy] * 4, rngs=[rng] * 4)
    engine.cost = 2.0
    for _ in range(8):
        right.step(engine, np.array([1, 2, 3, 4]), active=np.ones(4, bool), contexts=[[1], [2], [3], [4]],
                   params=[greedy] * 4, rngs=[rng] * 4)
    assert right.policy.num_skipped == 0 and right.stats.num_steps == 9


def test_tiny_ragged_verify_rows_are_padded_with_the_last_real_token(tiny_chat_family):
    """Rows past a sequence's own draft repeat its last real token: never id 0 (see runtime/engine/engine.py `_run`)."""
    from staticlm.runtime.speculative.batch_speculative import BatchSpeculator

    prompt = open_tokenizer(tiny_chat_family).encode("abcabc", add_special_tokens=False)
    single = Engine(tiny_chat_family, options=CPU)
    single.prefill(prompt)
    batch = Engine(tiny_chat_family, options=CPU, batch=4, weights_from=single)
    batch.load_prefix(single)
    fed: list[tuple[np.ndarray, np.ndarray]] = []
    verify = batch.verify

    def spy(token_ids, *, num_real=None):
        fed.append((np.array(token_ids), np.array(num_real)))
        return verify(token_ids, num_real=num_real)

    batch.verify = spy
    # drafts of 0, 1, 2 and 3 tokens (id 7: never 0), so every step's batch is ragged
    drafters = [_ConstantDrafter(7, max_tokens=n) for n in range(4)]
    speculator = BatchSpeculator(drafters, length=DraftLength(initial=3, fixed=True), probe_every=1)
    greedy, rng = SamplingParams(temperature=0.0), np.random.default_rng(0)
    generated = [[11], [12], [13], [14]]
    for _ in range(4):
        fresh = speculator.step(batch, np.array([g[-1] for g in generated]), active=np.ones(4, bool),
                                contexts=[prompt + g for g in generated], params=[greedy] * 4, rngs=[rng] * 4)
        for b in range(4):
            generated[b].extend(fresh[b])
    assert len(fed) == 4
    num_checked = 0
    for ids, num_real in fed:
        assert num_real.tolist() == [1, 2, 3, 4] and ids.shape == (4, 4)
        for b in range(4):
            real = ids[b, :num_real[b]]
            assert (ids[b, num_real[b]:] == real[-1]).all(), f"sequence {b}: {ids[b].tolist()}"
        if not any((ids[b, :num_real[b]] == 0).any() for b in range(4)):
            assert not (ids == 0).any(), ids.tolist()
            num_checked += 1
    assert num_checked > 0  # some step had no real id 0, so id 0 anywhere would have been padding


def test_tiny_num_responses_with_lookup_cli_equals_transformers(tiny_chat_family, tiny_hf_model):
    import json
    import subprocess
    import sys

    prompt = "abcabcabc abcabc abc"
    out = subprocess.run([sys.executable, "-m", "staticlm.apps.cli", "generate", "--model", str(tiny_chat_family),
                          "--prompt", prompt, "--no-chat", "--num-responses", "4", "--speculate", "lookup",
                          "--max-new-tokens", "20", "--ignore-eos", "--json", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    ids = open_tokenizer(tiny_chat_family).encode(prompt, add_special_tokens=True)
    want = hf_greedy(tiny_hf_model, ids, 20)
    assert [r["token_ids"] for r in summary["responses"]] == [want] * 4
    assert summary["verify_steps"] > 0 and summary["accepted_tokens"] > 0
    assert summary["verify_real_rows"] <= summary["verify_rows"]
