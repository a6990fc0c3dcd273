"""A reasoning model behind `staticlm serve`: a tiny random Qwen3 with a thinking chat template (built here, no
downloads), through the official openai client on loopback. References: the model's one-sequence Generator in
this process (greedy), with the budget's forced `</think>` fed to it by hand."""
from __future__ import annotations

import json
import subprocess

import pytest
from serve_helpers import openai_client, reference_model, running_server, serve_command

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

THINK_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
THINK_TOKENS = ["<think>", "</think>"]  # ids 260 and 261, plain added tokens as in Qwen3's tokenizer
MAX_NEW = 16


@pytest.fixture(scope="module")
def thinking_family(tmp_path_factory):
    import torch
    from conftest import TINY_SPECIALS, save_tiny_checkpoint
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.sources import load_model

    hf = tmp_path_factory.mktemp("tiny_qwen3_thinking")
    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=259, eos_token_id=258,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # as tiny_archs.build: sharper, and untied (a tied one only repeats its last token here)
        model.model.embed_tokens.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    save_tiny_checkpoint(model, hf)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    tok.add_tokens(THINK_TOKENS)
    assert [tok.token_to_id(t) for t in TINY_SPECIALS + THINK_TOKENS] == list(range(256, 262))
    tok.save(str(hf / "tokenizer.json"))
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": THINK_TEMPLATE}))
    out = tmp_path_factory.mktemp("tiny_qwen3_thinking_family") / "family"
    export_family(load_model(hf), out, options=ExportOptions(contexts=(256, 512), prefill_len=16, verify_lens=(4,)))
    return out


@pytest.fixture(scope="module")
def server(thinking_family):
    with running_server(thinking_family) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


@pytest.fixture(scope="module")
def reference(thinking_family):
    return reference_model(thinking_family)


def _prompt(model, text: str, **template_kwargs) -> list[int]:
    from staticlm.runtime.text.chat_template import Message

    return model.format.prompt_ids([Message(role="user", content=text)], template_kwargs=template_kwargs or None)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    from staticlm.runtime.generate.text_stream import GenerationParams

    model.generator.reset()
    return list(model.generate(ids, GenerationParams(max_new_tokens=n, ignore_eos=True)).token_ids)


def _ask(client, text: str, *, stream: bool = False, **extra):
    kw = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": text}],
              max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True, **extra})
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return getattr(m, "reasoning_content", None), m.content, m
    thoughts, answer = [], []
    for c in client.chat.completions.create(**kw, stream=True):
        d = c.choices[0].delta if c.choices else None
        thoughts.append(getattr(d, "reasoning_content", None) or "")
        answer.append((d.content or "") if d else "")
    return "".join(thoughts), "".join(answer), None


def test_the_thoughts_are_split_out_streamed_and_not(client, reference):
    prompt = _prompt(reference, "abc")
    assert reference.tokenizer.decode(prompt).endswith("<think>\n")  # the answer starts inside the thoughts
    text = reference.tokenizer.decode(_greedy(reference, prompt, MAX_NEW))
    assert text.strip()  # (an answer of blanks would make this test say nothing)
    before, closed, after = text.partition("</think>")
    want = (before.strip(), after.lstrip() if closed else "")
    thoughts, answer, message = _ask(client, "abc")
    assert (thoughts, answer or "") == want and "<think>" not in (answer or "")
    s_thoughts, s_answer, _ = _ask(client, "abc", stream=True)
    assert (s_thoughts.strip(), s_answer) == (want[0], want[1])


@pytest.mark.parametrize("budget", [3, 7])
def test_the_budget_forces_the_close_after_that_many_reasoning_tokens(client, reference, budget):
    prompt = _prompt(reference, "abc")
    close = reference.tokenizer.encode("</think>", add_special_tokens=False)
    assert close == [261]
    thought = _greedy(reference, prompt, budget)
    rest = _greedy(reference, prompt + thought + close, MAX_NEW - budget - 1)
    want_thoughts = reference.tokenizer.decode(thought).strip()
    want_answer = reference.tokenizer.decode(rest).lstrip()
    assert want_thoughts and want_answer
    if "</think>" in reference.tokenizer.decode(thought):
        pytest.skip("the random model closed its thoughts itself within the budget: nothing to force")
    for stream in (False, True):
        thoughts, answer, _ = _ask(client, "abc", stream=stream, reasoning_budget=budget)
        assert (thoughts.strip(), answer) == (want_thoughts, want_answer), stream


def test_the_messages_and_responses_apis_carry_the_same_thoughts(server, client):
    anthropic = pytest.importorskip("anthropic")
    want_thoughts, want_answer, _ = _ask(client, "abc", reasoning_budget=5)
    model = client.models.list().data[0].id
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=model, max_tokens=MAX_NEW, messages=[{"role": "user", "content": "abc"}],
              thinking={"type": "enabled", "budget_tokens": 5}, extra_body={"temperature": 0, "ignore_eos": True})
    got = claude.messages.create(**kw)
    assert [b.type for b in got.content] == ["thinking", "text"]
    assert (got.content[0].thinking, got.content[1].text) == (want_thoughts, want_answer)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.content[0].thinking.strip(), final.content[1].text) == (want_thoughts, want_answer)
    off = claude.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    r = client.responses.create(model=model, input="abc", max_output_tokens=MAX_NEW, temperature=0,
                                extra_body={"ignore_eos": True, "reasoning_budget": 5})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == want_thoughts and r.output_text == want_answer


def test_thinking_off_by_template_kwargs_soft_switch_or_a_zero_budget(client, reference):
    off = _prompt(reference, "abc", enable_thinking=False)
    assert "<think>\n\n</think>" in reference.tokenizer.decode(off)
    want = reference.tokenizer.decode(_greedy(reference, off, MAX_NEW))
    assert not want.lstrip().startswith("<think>")  # (the random model does not open a block of its own)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_budget": 0}):
        for stream in (False, True):
            thoughts, answer, _ = _ask(client, "abc", stream=stream, **extra)
            assert not thoughts and answer == want, (extra, stream)
    soft = _prompt(reference, "abc /no_think", enable_thinking=False)
    got = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                         messages=[{"role": "user", "content": "abc /no_think"}])
    assert got.usage.prompt_tokens == len(soft) and getattr(got.choices[0].message, "reasoning_content", None) is None


def test_bad_budgets_and_template_kwargs_are_400s_and_the_server_keeps_serving(server, client):
    import httpx

    for extra, param in (({"reasoning_budget": -5}, "reasoning_budget"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "x"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert _ask(client, "x")[0] is not None
    r = subprocess.run(serve_command("--model", "nowhere", "--reasoning-budget", "-2"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--reasoning-budget" in r.stderr


# -- pure parts -------------------------------------------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", " ", "\n", "a", "b c",
                                   "<", "/think"]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=PIECES, started=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_the_streamed_split_equals_the_whole_one_wherever_the_deltas_break(text, started, cuts):
    from staticlm.apps.serve.reasoning import ReasoningStream, split_reasoning

    stream, thoughts, answer, last = ReasoningStream(started=started), [], [], 0
    for cut in sorted({min(c, len(text)) for c in cuts}) + [len(text)]:
        t, a = stream.push(text[last:cut])
        thoughts.append(t)
        answer.append(a)
        last = cut
    t, a = stream.flush()
    want_thoughts, want_answer = split_reasoning(text, started=started)
    assert "".join(answer + [a]) == want_answer
    assert "".join(thoughts + [t]).strip() == (want_thoughts or "")


class _ByteTokens:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_a_budget_counts_only_thoughts_the_model_opened_itself_then_forces_the_close_then_hands_over():
    import numpy as np

    from staticlm.apps.serve.reasoning import BudgetConstraints

    class Inner:
        seen: list[int] = []

        def allowed(self, vocab_size):
            return np.ones(vocab_size, bool)

        def consume(self, token_id):
            self.seen.append(token_id)

    close = [ord(c) for c in "</think>"]
    c = BudgetConstraints(budget=3, close_ids=close, tokenizer=_ByteTokens(), started=False, inner=Inner)()
    for ch in " <think>":  # the answer opens its thoughts itself: nothing counted, nothing forced
        assert c.allowed(128) is None
        c.consume(ord(ch))
    for ch in "abc":
        assert c.allowed(128) is None
        c.consume(ord(ch))
    for want in close:  # the budget is spent: the close tag, one id at a time
        mask = c.allowed(128)
        assert mask.sum() == 1 and mask[want]
        c.consume(want)
    assert c.allowed(128).all()  # the inner constraint's now
    c.consume(ord("x"))
    assert c.inner.seen == [ord("x")]
    free = BudgetConstraints(budget=3, close_ids=close, tokenizer=_ByteTokens(), started=False)()
    for ch in "no thoughts at all":  # an answer that does not open <think> is never forced
        assert free.allowed(128) is None
        free.consume(ord(ch))
