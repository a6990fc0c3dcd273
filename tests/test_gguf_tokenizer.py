"""GGUF tokenizers and chat templates against transformers' own GGUF loader, on small files written here.

Each vocabulary is trained with `tokenizers` on a small multilingual text and written into a GGUF's
`tokenizer.ggml.*` metadata with gguf.GGUFWriter (one tiny tensor, no download). transformers'
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` is the reference for ids, decoding, specials and BOS handling;
its `apply_chat_template(..., tools=...)` is the reference for the file's own chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from staticlm.export.sources.gguf_file import GGUFFile
from staticlm.export.sources.gguf_tokenizer import GGUFTokenizer, build_tokenizer
from staticlm.export.sources.model import ModelSourceError
from staticlm.runtime.chat import ChatFormat
from staticlm.runtime.text.chat_template import Message
from staticlm.runtime.text.detokenizer import StreamDecoder
from staticlm.runtime.text.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CORPUS = """The quick brown fox jumps over the lazy dog. It's 2024; we've 1234567 apples, don't we? I'LL see.
Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, merci ! Größe, Straße, naïve café.
Привет, как дела? Всё хорошо. 東京は日本の首都です。中文分词测试，你好世界！ひらがなとカタカナ。
한국어 문장도 넣어 봅시다. مرحبا بالعالم. नमस्ते दुनिया। Ελληνικά κείμενα. Emoji: 😀🎉👍🏽 ❤️ 🇫🇷 🤖
def main(argv: list[str]) -> int:
    for i, x in enumerate(argv):
        if x == "--help":
            print(f"usage: {argv[0]} [options]\n")  # comment
    return 0
{"key": [1, 2.5, null], 'tabs':\t"x"}   x <= y && z != 0x1F;
"""
TEXTS = [
    CORPUS,
    "Hello, world! Bonjour, le monde ! 你好，世界！ Привет, мир! 😀👍🏽🇯🇵 and a 🦜 unseen",
    "def f(x):\n\treturn x ** 2  # 🐍 squares\n\n\n    indented = {'a': [1, 22, 333, 4444]}\r\n",
    "  leading spaces\n\n\tand tabs  ", " ", "", "a\n 4", "   x", "1234567890 12 ,.;", "ünïcödé  ǅ  ﬁ  Ｆｕｌｌ",
    "<|im_start|>user\nhi<|im_end|>\n<|begin_of_text|><|eot_id|><bos>ok<eos><start_of_turn><think>x</think>",
    "<s> x</s><unk><|user|>hi <|end|>\n<|assistant|> ",
    "unseen: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b\u00a0 ☃",
    "    def wrap(self, text):\n        \"\"\"wrap(text : string) -> [string]\"\"\"\n"
    "        return self._wrap_chunks(chunks)\n",
]

QWEN25_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''  # noqa: E501
# Llama 3.1 Instruct's template (the version with a fixed date_string default).
LLAMA31_TEMPLATE = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''  # noqa: E501
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


# ---------------------------------------------------------------------------------------------- building files
def _trained(pre_tokenizer, *, vocab_size: int, byte_fallback: bool = False, alphabet=()) -> list:
    """A BPE trained on CORPUS: (tokens in id order, merges)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, trainers

    tok = HF(models.BPE(byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=list(alphabet), show_progress=False,
                                  max_token_length=12)
    tok.train_from_iterator(_training_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def _training_lines() -> list[str]:
    """CORPUS and some real code and prose (the stdlib's textwrap and this file), so merges run deep."""
    import textwrap

    return CORPUS.splitlines() * 3 + Path(textwrap.__file__).read_text().splitlines() + \
        Path(__file__).read_text(encoding="utf-8").splitlines()


def _byte_level_vocab(split: str):
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return _trained(pre, vocab_size=3000, alphabet=pre_tokenizers.ByteLevel.alphabet())


def _write(path: Path, arch: str, tokens: list[str], types: list[int], *, model: str, meta: dict) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_array(key, np.asarray(value, dtype=np.float32).tolist())
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))  # all transformers needs of weights
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _qwen2_file(directory: Path) -> Path:
    tokens, merges = _byte_level_vocab(QWEN2_SPLIT)
    extra = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
             ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED), ("<think>", USER_DEFINED),
             ("</think>", USER_DEFINED), ("<｜mislabeled▁control｜>", CONTROL)]
    types = [NORMAL] * len(tokens) + [t for _, t in extra]
    tokens = tokens + [t for t, _ in extra]
    return _write(directory / "qwen2.gguf", "qwen2", tokens, types, model="gpt2", meta={
        "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"), "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": QWEN25_TEMPLATE,
    })


def _llama3_file(directory: Path) -> Path:
    tokens, merges = _byte_level_vocab(LLAMA3_SPLIT)
    extra = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
             "<|eom_id|>"] + [f"<|reserved_special_token_{i}|>" for i in range(3)]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(extra)
    tokens = tokens + extra
    return _write(directory / "llama3.gguf", "llama", tokens, types, model="gpt2", meta={
        "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|begin_of_text|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|eot_id|>"),
        "tokenizer.ggml.eom_token_id": tokens.index("<|eom_id|>"), "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": LLAMA31_TEMPLATE,
    })


def _gemma_file(directory: Path) -> Path:
    """Gemma's layout: specials first, the 256 byte-fallback tokens, then pieces (with runs of real spaces), no
    merges and scores that do not follow merge order."""
    from tokenizers import pre_tokenizers

    pieces, _ = _trained(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
                         vocab_size=3000, byte_fallback=True)
    specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", CONTROL),
                ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [t for _, t in specials] + [BYTE] * 256
    for piece in [p for p in pieces if p not in tokens] + ["  ", "    ", "\n\n", "\t"]:
        tokens.append(piece)
        types.append(NORMAL)
    rng = np.random.default_rng(0)
    scores = rng.uniform(-1000, 0, len(tokens)).tolist()  # Gemma's scores say nothing of merge order
    return _write(directory / "gemma3.gguf", "gemma3", tokens, types, model="llama", meta={
        "tokenizer.ggml.pre": "default", "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False, "tokenizer.chat_template": GEMMA_TEMPLATE,
    })


def _sentencepiece_file(directory: Path, arch: str) -> Path:
    """Llama 2's layout (<unk>, <s>, </s>, the byte tokens, then pieces scored by merge rank); phi3 adds its chat
    tokens. No `add_bos_token` flag: an old file, for which BOS is added by default."""
    from tokenizers import pre_tokenizers

    pieces, _ = _trained(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
                         vocab_size=3000, byte_fallback=True)
    specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [t for _, t in specials] + [BYTE] * 256
    tokens += [p for p in pieces if p not in tokens]
    types += [NORMAL] * (len(tokens) - len(types))
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(tokens) - 3 - 256)]
    if arch == "phi3":
        for t in ("<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"):
            tokens.append(t)
            types.append(CONTROL if t != "<|user|>" else USER_DEFINED)
            scores.append(0.0)
    return _write(directory / f"{arch}_spm.gguf", arch, tokens, types, model="llama", meta={
        "tokenizer.ggml.pre": "default", "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    })


# Byte-level BPE, and Gemma's SentencePiece (no prefix space), give back any text. Llama-style SentencePiece adds a
# "▁" before the text unless it starts with one, and strips one space off the decode: "  x" comes back as " x",
# in transformers as here (llama.cpp always adds the prefix).
LOSSLESS = {"qwen2", "llama3", "gemma3"}
KINDS = {"qwen2": _qwen2_file, "llama3": _llama3_file, "gemma3": _gemma_file,
         "llama_spm": lambda d: _sentencepiece_file(d, "llama"), "phi3_spm": lambda d: _sentencepiece_file(d, "phi3")}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("gguf_tokenizers")
    return {kind: make(directory) for kind, make in KINDS.items()}


@pytest.fixture(scope="module")
def pairs(gguf_files) -> dict[str, tuple[GGUFTokenizer, object]]:
    """kind -> (ours, transformers' tokenizer from the same file)."""
    from transformers import AutoTokenizer

    out = {}
    for kind, path in gguf_files.items():
        ours = build_tokenizer(GGUFFile(path).metadata, name=path.name)
        out[kind] = ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return out


def _runtime(ours: GGUFTokenizer) -> Tokenizer:
    from tokenizers import Tokenizer as HF

    return Tokenizer(HF.from_str(ours.tokenizer_json), bos_token_id=ours.bos_token_id,
                     eos_token_ids=ours.eos_token_ids, add_bos_token=ours.add_bos_token)


# ---------------------------------------------------------------------------------------------- tokenizer parity
@pytest.mark.parametrize("kind", list(KINDS))
def test_gguf_tokenizer_ids_equal_transformers(pairs, kind):
    ours, ref = pairs[kind]
    tok = _runtime(ours)
    assert tok.vocab_size == ref.vocab_size
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        # with the file's BOS/EOS rule, as the runtime applies it (no second BOS)
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True), text


@pytest.mark.parametrize("kind", list(KINDS))
def test_gguf_tokenizer_decodes_like_transformers_and_round_trips(pairs, kind):
    ours, ref = pairs[kind]
    tok = _runtime(ours)
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        if kind in LOSSLESS:
            assert tok.decode(ids) == text
        stream = StreamDecoder(tok)
        shown = "".join(stream.push(i) for i in ids) + stream.flush()
        assert shown == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gguf_tokenizer_specials_equal_transformers(pairs, gguf_files, kind):
    ours, ref = pairs[kind]
    num_tokens = len(GGUFFile(gguf_files[kind]).metadata["tokenizer.ggml.tokens"])
    ours_added = {i: (t.content, t.special) for i, t in _runtime(ours)._tok.get_added_tokens_decoder().items()}
    # transformers appends its class's default unk (<|endoftext|>) past the vocabulary when the file has none:
    # an id the model has no row for, left out here.
    ref_added = {i: (t.content, t.special) for i, t in ref.added_tokens_decoder.items() if i < num_tokens}
    assert ours_added == ref_added
    assert ours.bos_token == ref.bos_token and ours.eos_token == ref.eos_token
    assert ours.add_bos_token == ref.add_bos_token
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert ours.chat_template == ref.chat_template


def test_gguf_stop_tokens_and_kinds(pairs):
    qwen, _ = pairs["qwen2"]
    llama, _ = pairs["llama3"]
    tok = _runtime(llama)
    assert list(llama.eos_token_ids) == [tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|eom_id|>")]
    assert _runtime(qwen).token_to_id("<|im_end|>") in qwen.eos_token_ids
    gemma, _ = pairs["gemma3"]
    assert list(gemma.eos_token_ids) == [1, _runtime(gemma).token_to_id("<end_of_turn>")]  # <eos>, the turn end
    # A user-defined token stays whole but is text: shown on decode even when specials are skipped.
    think = _runtime(qwen).encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and _runtime(qwen).decode(think, skip_special_tokens=True) == "<think>"


@pytest.mark.parametrize("meta, message", [
    ({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "tokenizer type 'rwkv' is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.pre": "made-up"},
     "pre-tokenizer 'made-up' is not supported"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "general.architecture": "llama"},
     "needs tokenizer.ggml.scores"),
    ({"general.architecture": "llama"}, "carries no tokenizer"),
])
def test_unsupported_gguf_tokenizers_are_one_line_errors(meta, message):
    with pytest.raises(ModelSourceError, match=message) as info:
        build_tokenizer(meta, name="x.gguf")
    assert "\n" not in str(info.value) and "x.gguf" in str(info.value)


# ---------------------------------------------------------------------------------------------- chat templates
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city — in °C.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
OPENAI_CONVERSATION = [  # as an OpenAI client sends it: JSON-string arguments, content None beside tool calls
    {"role": "system", "content": "You are terse. <b>HTML</b> & \"quotes\" stay as they are."},
    {"role": "user", "content": "Weather in Zürich and 東京? 🌦"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"celsius\"}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21.5}"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "Zürich 21.5 °C, 東京 18 °C."},
    {"role": "user", "content": "And the time?"},
]


def _as_transformers_expects(messages: list[dict]) -> list[dict]:
    """The same conversation with arguments as objects (what chat templates are written for)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_gguf_chat_template_with_tools_equals_transformers(pairs, add_generation_prompt, with_tools):
    ours, ref = pairs["qwen2"]
    fmt = ChatFormat(tokenizer=_runtime(ours), chat_template=ours.chat_template, bos_token=ours.bos_token,
                     eos_token=ours.eos_token)
    tools = TOOLS if with_tools else None
    expected = ref.apply_chat_template(_as_transformers_expects(OPENAI_CONVERSATION), tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    assert "<tool_call>" in expected and "<tool_response>" in expected and ("get_weather" in expected)
    messages = [Message.from_openai(m) for m in OPENAI_CONVERSATION]
    got = fmt.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == expected
    # OpenAI-shaped dicts straight through render as transformers renders the same dicts
    assert fmt.render(_as_transformers_expects(OPENAI_CONVERSATION), tools=tools,
                      add_generation_prompt=add_generation_prompt) == expected
    ids = fmt.prompt_ids(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ids == ref.encode(expected, add_special_tokens=False)
    assert fmt.supports_tools


LLAMA31_CONVERSATION = [  # one call per turn, as the template insists
    OPENAI_CONVERSATION[0], OPENAI_CONVERSATION[1],
    {"role": "assistant", "content": "", "tool_calls": OPENAI_CONVERSATION[2]["tool_calls"][:1]},
    OPENAI_CONVERSATION[3], OPENAI_CONVERSATION[5], OPENAI_CONVERSATION[6],
]


@pytest.mark.parametrize("template_kwargs", [{}, {"tools_in_user_message": False, "date_string": "1 Jan 2026"}])
@pytest.mark.parametrize("with_tools", [True, False])
def test_gguf_llama31_template_with_tools_equals_transformers(pairs, template_kwargs, with_tools):
    ours, ref = pairs["llama3"]
    fmt = ChatFormat(tokenizer=_runtime(ours), chat_template=ours.chat_template, bos_token=ours.bos_token,
                     eos_token=ours.eos_token)
    tools = TOOLS if with_tools else None
    expected = ref.apply_chat_template(_as_transformers_expects(LLAMA31_CONVERSATION), tools=tools, tokenize=False,
                                       add_generation_prompt=True, **template_kwargs)
    assert ('"parameters": {"city": "Zürich"' in expected) and ("Environment: ipython" in expected) == with_tools
    messages = [Message.from_openai(m) for m in LLAMA31_CONVERSATION]
    assert fmt.render(messages, tools=tools, template_kwargs=template_kwargs) == expected
    ids = fmt.prompt_ids(messages, tools=tools, template_kwargs=template_kwargs)
    assert ids == ref.encode(expected, add_special_tokens=False) and ids.count(ours.bos_token_id) == 1


@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_gguf_chat_templates_with_bos_equal_transformers(pairs, kind):
    ours, ref = pairs[kind]
    fmt = ChatFormat(tokenizer=_runtime(ours), chat_template=ours.chat_template, bos_token=ours.bos_token,
                     eos_token=ours.eos_token)
    messages = [m for m in OPENAI_CONVERSATION if m["role"] in ("user",) or (m["role"] == "assistant" and m["content"])]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert fmt.render([Message.from_openai(m) for m in messages]) == expected
    ids = fmt.prompt_ids([Message.from_openai(m) for m in messages])
    assert ids == ref.encode(expected, add_special_tokens=False) and ids.count(ours.bos_token_id) == 1


def test_gguf_named_chat_templates_are_picked_like_transformers(tmp_path):
    tokens = ["a", "b", "<|im_end|>"]
    path = _write(tmp_path / "named.gguf", "qwen2", tokens, [NORMAL, NORMAL, CONTROL], model="gpt2", meta={
        "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.merges": [], "tokenizer.chat_template": "plain",
        "tokenizer.chat_template.tool_use": "tools:{{ tools | length }}<|im_end|>",
    })
    ours = build_tokenizer(GGUFFile(path).metadata, name=path.name)
    assert ours.chat_template == "plain" and ours.chat_templates == {"tool_use": "tools:{{ tools | length }}<|im_end|>"}
    assert ours.eos_token_ids == (2,)  # a ChatML end in a named template stops generation too
    fmt = ChatFormat(tokenizer=_runtime(ours), chat_template={"default": ours.chat_template, **ours.chat_templates},
                     bos_token=None, eos_token=None)
    assert fmt.render([Message("user", "a")], tools=TOOLS) == "tools:2<|im_end|>"
    assert fmt.render([Message("user", "a")]) == "plain"
