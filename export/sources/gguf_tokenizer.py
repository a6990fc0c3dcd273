"""Rebuild a HF `tokenizers` tokenizer.json from the tokenizer a GGUF file carries.

The same tokenizer transformers builds from the file (`transformers.integrations.gguf.gguf_tokenizer_mapping`,
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), built here without transformers:
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE (Qwen2/2.5/3, Llama 3, SmolLM, Phi-4-mini), split per
  `tokenizer.ggml.pre` as llama.cpp splits;
- `"llama"`: SentencePiece BPE with byte fallback (Llama 2, Mistral), with Gemma's and Phi-3's variants picked by
  `general.architecture`, as transformers picks them.
Anything else is refused by name: guessing would tokenize silently differently from the model's training.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.pre_tokenizers import ByteLevel

from .model import ModelSourceError

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Turn ends that chat templates write (ChatML, Llama 3, Phi-3/4, Gemma): llama.cpp stops generation at them too.
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_SPACE = "\u2581"  # SentencePiece's visible space

# Split regexes as llama.cpp applies them per `tokenizer.ggml.pre` (llama-vocab.cpp); transformers' table.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O),
}
_GPT2_LIKE = {"default", "gpt2", "gpt-2"}  # the plain GPT-2 regex (ByteLevel's own)
# llama.cpp's "smollm" splits `\p{N}` before the GPT-2 regex, as the HF SmolLM2 tokenizer.json does
# (Digits(individual_digits) + ByteLevel). transformers' GGUF path skips the digit split; here we follow llama.cpp.
_DIGITS_THEN_GPT2 = {"smollm"}
# SentencePiece files whose tokenizer transformers builds differently from Llama's (by architecture).
_GEMMA_ARCHS, _PHI3_ARCHS = {"gemma", "gemma2", "gemma3"}, {"phi3"}


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer_json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    # Named templates (`tokenizer.chat_template.<name>`, e.g. tool_use), beside the default one.
    chat_templates: dict[str, str] = field(default_factory=dict)


def build_tokenizer(meta: dict[str, Any], *, name: str) -> GGUFTokenizer:
    """`meta` is the GGUF metadata; `name` labels errors (the file name)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelSourceError(f"{name} carries no tokenizer (no tokenizer.ggml.model)")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelSourceError(f"{name} carries no token list (tokenizer.ggml.tokens)")
    raw_types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in raw_types] if raw_types is not None else [1] * len(tokens)
    arch = str(meta.get("general.architecture", ""))
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, types, name=name)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, arch=arch, name=name)
    else:
        raise ModelSourceError(f"{name}: tokenizer type {kind!r} is not supported "
                               "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    ids = {key: _token_id(meta.get(f"tokenizer.ggml.{key}_token_id"), len(tokens))
           for key in ("bos", "eos", "eot", "eom", "unknown", "padding")}
    named = {ids[k] for k in ("bos", "eos", "unknown", "padding") if ids[k] is not None}
    _add_special_tokens(tok, tokens, types, byte_level=kind == "gpt2", named=named)
    bos_id, eos_id = ids["bos"], ids["eos"]
    # Older SentencePiece files carry no flag, and llama.cpp then adds BOS (so does transformers).
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    tok.post_processor = _post_processor(tokens, bos_id if add_bos else None, eos_id if add_eos else None)

    template = meta.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    templates = {key[len("tokenizer.chat_template."):]: value for key, value in meta.items()
                 if key.startswith("tokenizer.chat_template.") and isinstance(value, str)}
    eos_ids = [i for i in (eos_id, ids["eot"], ids["eom"]) if i is not None]
    # A template that ends each turn with <|im_end|> (or <end_of_turn>, <|end|>...): generation must stop there
    # even when the file's eos is <|endoftext|>.
    texts = (template or "", *templates.values())
    eos_ids += [tok.token_to_id(end) for end in _TURN_ENDS
                if any(end in t for t in texts) and tok.token_to_id(end) is not None]
    return GGUFTokenizer(
        tokenizer_json=tok.to_str(), chat_template=template, bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos_token=add_bos, chat_templates=templates,
    )


def _byte_level(meta: dict[str, Any], tokens: list[str], types: list[int], *, name: str) -> Tokenizer:
    # Some converters store tokens as raw UTF-8 instead of the byte alphabet: respell those, as transformers
    # does, so BPE sees one spelling. (A later duplicate wins, as in llama.cpp's and transformers' maps.)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise ModelSourceError(f"{name}: malformed tokenizer.ggml.merges (a merge is not two tokens)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = _split(str(meta.get("tokenizer.ggml.pre", "default")), name=name)
    tok.decoder = decoders.ByteLevel()
    return tok


def _split(pre: str, *, name: str) -> Any:
    if pre in _GPT2_LIKE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = sorted(_GPT2_LIKE | _DIGITS_THEN_GPT2 | set(_REGEX_SPLITS))
    raise ModelSourceError(f"{name}: pre-tokenizer {pre!r} is not supported (known: {', '.join(known)})")


def _sentencepiece(meta: dict[str, Any], tokens: list[str], *, arch: str, name: str) -> Tokenizer:
    """SentencePiece BPE as transformers' LlamaTokenizer / GemmaTokenizer build it, merges recovered from the
    vocabulary when the file lists none (Gemma: ranked by file order, whose scores do not follow merge order)."""
    gemma = arch in _GEMMA_ARCHS
    if gemma:  # a run of spaces is stored as real spaces, but looked up as "▁▁"
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    elif gemma:
        merges = _merges_from_vocab(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelSourceError(f"{name}: a SentencePiece vocabulary needs tokenizer.ggml.scores or merges")
        merges = _merges_from_vocab(vocab, {t: float(s) for t, s in zip(tokens, scores)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               unk_token="<unk>" if gemma else None))
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(steps)
        return tok
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    if arch in _PHI3_ARCHS:  # the prefix space comes from a normalizer, not from Metaspace
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    return tok


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best score first (transformers' generate_merges)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int], *, byte_level: bool,
                        named: set[int]) -> None:
    """Control tokens (e.g. <|im_start|>) stay whole and are skippable on decode; user-defined ones (<think>) stay
    whole. In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp mislabel and
    is left alone; SentencePiece's <unk> and the file's bos/eos/unk/pad tokens are special too -- as transformers
    does."""
    alphabet = set(ByteLevel.alphabet())
    special_types = {_CONTROL} if byte_level else {_CONTROL, _UNKNOWN}
    control = [AddedToken(t, special=True, normalized=False) for i, (t, ty) in enumerate(zip(tokens, types))
               if (ty in special_types or i in named) and (not byte_level or set(t) <= alphabet)]
    vocab = tok.get_vocab()
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab]
    if control:
        tok.add_special_tokens(list({t.content: t for t in control}.values()))
    if user:
        tok.add_tokens(user)


def _post_processor(tokens: list[str], bos_id: int | None, eos_id: int | None) -> Any:
    """BOS/EOS around a sequence as the file asks (transformers' update_post_processor)."""
    bos, eos = (tokens[bos_id] if bos_id is not None else None), (tokens[eos_id] if eos_id is not None else None)
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


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
