"""Rebuild a HF `tokenizers` tokenizer.json from the tokenizer a GGUF file carries.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: that is what SmolLM2,
Llama 3 and most Llama-architecture GGUFs with a BPE vocabulary use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from .model import ModelSourceError

_CONTROL, _USER_DEFINED = 3, 4
_CHATML_END = "<|im_end|>"

# Split regexes as llama.cpp applies them per `tokenizer.ggml.pre` (llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                 "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Plain GPT-2 regex (ByteLevel's own).
_GPT2_LIKE = {"default", "gpt2", "gpt-2"}
# GPT-2 regex after splitting every digit apart: the HF SmolLM2 tokenizer.json is exactly
# Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)], and llama.cpp's
# "smollm" pre-tokenizer is `\p{N}` then the GPT-2 regex.
_DIGITS_THEN_GPT2 = {"smollm"}


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


def build_tokenizer(meta: dict[str, Any], *, name: str) -> GGUFTokenizer:
    """`meta` is the GGUF metadata; `name` labels errors (the file name)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelSourceError(f"{name} carries no tokenizer (no tokenizer.ggml.model)")
    if kind != "gpt2":
        raise ModelSourceError(f"{name}: tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    token_types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in token_types] if token_types is not None else [1] * len(tokens)

    # Some converters store tokens as raw UTF-8 instead of the byte alphabet: respell those, as
    # transformers does, so BPE sees one spelling.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet and types[index] not in (_CONTROL, _USER_DEFINED):
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), name=name)
    tok.decoder = decoders.ByteLevel()

    # Control tokens (e.g. <|im_start|>) must stay whole and be skippable on decode; a control token
    # spelled outside the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does).
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)

    bos_id = _token_id(meta.get("tokenizer.ggml.bos_token_id"), len(tokens))
    eos_id = _token_id(meta.get("tokenizer.ggml.eos_token_id"), len(tokens))
    template = meta.get("tokenizer.chat_template")
    eos_ids = [eos_id] if eos_id is not None else []
    eot_id = _token_id(meta.get("tokenizer.ggml.eot_token_id"), len(tokens))
    if eot_id is not None:
        eos_ids.append(eot_id)
    # A ChatML template ends each turn with <|im_end|>; generation must stop there even when the
    # file's eos is <|endoftext|>.
    if template and _CHATML_END in template and _CHATML_END in vocab:
        eos_ids.append(vocab[_CHATML_END])
    return GGUFTokenizer(
        tokenizer_json=tok.to_str(),
        chat_template=template if isinstance(template, str) else None,
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def _pre_tokenizer(pre: str, *, name: str):
    if pre in _GPT2_LIKE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # Guessing would tokenize silently differently from the model's training: refuse instead.
    known = sorted(_GPT2_LIKE | _DIGITS_THEN_GPT2 | set(_REGEX_SPLITS))
    raise ModelSourceError(f"{name}: pre-tokenizer {pre!r} is not supported (known: {', '.join(known)})")


def _token_id(value: Any, vocab_size: int) -> int | None:
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < vocab_size else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel.alphabet() holds)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    table = dict(zip(printable, (chr(c) for c in chars)))
    assert set(table.values()) == set(ByteLevel.alphabet())
    return table
