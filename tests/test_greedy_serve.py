"""One greedy request, five ways: through `staticlm serve` cold, with a warm prompt cache, beside 3 other clients and
with speculation, and through the model's own generation (what `generate` runs). All give the same tokens, on the
default model and on a tiny model of each architecture (those through the loop the server steps).

The reference is the model opened in this process with no cache (a cold single run); test_greedy_paths.py covers
the loop's paths one by one.
"""
from __future__ import annotations

import threading

import pytest
import tiny_archs
from conftest import THREADS
from serve_helpers import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow
PROMPT = "Write three sentences about the history of the bicycle and how it changed city life."
OTHERS = ["List five fruits and their colours.", "Explain what a prime number is.",
          "Describe a rainy morning in a small harbour town."]
MAX_TOKENS = 40


def _completion(base: str, prompt: str, *, max_tokens: int = MAX_TOKENS) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return got.choices[0].text


def _beside_three_others(base: str) -> str:
    """The request sent while three other clients' answers decode."""
    started = threading.Barrier(len(OTHERS) + 1)
    threads = [threading.Thread(target=lambda p=p: (started.wait(), _completion(base, p, max_tokens=3 * MAX_TOKENS)))
               for p in OTHERS]
    for t in threads:
        t.start()
    started.wait()
    answer = _completion(base, PROMPT)
    for t in threads:
        t.join()
    return answer


def _reference(family) -> str:
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    model = Model.open(family, RunOptions(device="cpu", num_threads=THREADS))
    ids = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    return model.generate(ids, GenerationParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)).text


def test_a_greedy_request_answers_alike_through_serve_and_generate(smollm2_cpu_family):
    want = _reference(smollm2_cpu_family)
    with running_server(smollm2_cpu_family) as base:
        got = {"cold": _completion(base, PROMPT), "warm cache": _completion(base, PROMPT),
               "beside 3 other clients": _beside_three_others(base)}
    with running_server(smollm2_cpu_family, "--speculate", "lookup") as base:
        got["speculation"] = _completion(base, PROMPT)
        got["speculation, warm cache"] = _completion(base, PROMPT)
    assert {path: answer == want for path, answer in got.items()} == dict.fromkeys(got, True), (want, got)


@pytest.mark.parametrize("arch", tiny_archs.ARCHS)
def test_a_greedy_request_answers_alike_on_every_path_of_the_loop_per_architecture(tiny, arch, tmp_path):
    """A tiny model of each architecture, from its GGUF: the loop the server steps, cold, warm, beside 3 other
    requests (in batch rows where the family has them), with speculation and as n = 3 choices."""
    from conftest import model_of

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime import kernels
    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.generate.sequence_request import Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.session.device import Device, DeviceOptions
    from staticlm.runtime.speculative.drafters import PromptLookupDrafter
    from staticlm.runtime.speculative.speculative import Speculator

    _hf_dir, _model, gguf = tiny(arch)
    family = tmp_path / "family"
    export_cpu_family(load_model(gguf), family, options=ExportOptions(contexts=(128,), prefill_len=16,
                                                                      verify_lens=(4,), batch_sizes=(4,)),
                      cpu=CpuOptions(gguf_kernels=kernels.available(), staticlm_attention=kernels.available()))
    options = EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS))
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    rng = __import__("numpy").random.default_rng(len(arch))
    prompt, others = [int(t) for t in rng.integers(3, 200, 40)], [[int(t) for t in rng.integers(3, 200, 30)]
                                                                  for _ in range(3)]
    model = model_of(Engine(family, options=options))
    want = model.generate(prompt, params).token_ids
    got = {"warm": model.generate(prompt, params).token_ids}
    finished: dict[int, list[int]] = {}
    for i, ids in enumerate([*others, prompt]):  # beside three others, joining one step apart
        model.loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=lambda e, i=i: (
            finished.__setitem__(i, list(e.token_ids)) if isinstance(e, Finished) else None)))
        model.loop.step()
    while model.loop.step():
        pass
    got["beside 3 others"] = finished[3]
    speculating = model_of(Engine(family, options=options), speculator=Speculator(PromptLookupDrafter()))
    got["speculation"] = speculating.generate(prompt, params).token_ids
    if model.loop.rows.available:  # sliding-window layers (gemma3) keep no batch rows: one sequence at a time
        got.update({f"choice {c}": r.token_ids for c, r in enumerate(model.generate_many(prompt, params,
                                                                                          num_responses=3))})
    assert {path: answer == want for path, answer in got.items()} == dict.fromkeys(got, True)


def _loops(token_ids: list[int], *, span: int = 6, times: int = 4) -> bool:
    """Whether some run of `span` tokens comes back `times` times or more (an answer repeating itself)."""
    runs = [tuple(token_ids[i:i + span]) for i in range(len(token_ids) - span + 1)]
    return any(runs.count(r) >= times for r in set(runs))


def test_the_readme_question_does_not_loop_under_the_default_sampling(smollm2_cpu_family):
    # The default model, greedy, repeats one phrase to the token limit on this question; the shared sampling
    # defaults (generation_defaults.py, what `generate` takes when no sampling flag is given) do not.
    from staticlm.runtime.generate.text_stream import FinishReason
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    def answer(**options):
        model = Model.open(smollm2_cpu_family, RunOptions(device="cpu", num_threads=THREADS, **options))
        chat = model.chat()
        "".join(chat.send("What is the capital of France?"))
        return chat.last_result

    greedy = answer(temperature=0)
    assert greedy.finish_reason is FinishReason.LENGTH and _loops(greedy.token_ids)  # why the defaults sample
    for seed in range(3):
        sampled = answer(seed=seed)
        assert not _loops(sampled.token_ids), (seed, sampled.text)
