"""Load a Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer.json).

safetensors files are parsed here (an 8-byte header length, a JSON header, raw little-endian
tensors) rather than with the `safetensors` package: its numpy backend cannot read bfloat16,
which is how most checkpoints ship, and the format is simple enough to need no dependency.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from staticlm.runtime.family.config import ModelConfig, UnsupportedModel
from staticlm.runtime.family.generation_defaults import FIELDS, checked

from .architectures import BY_HF_TYPE, KNOWN_UNSUPPORTED, add_norm_offset, source_shapes, unfuse
from .gemma import hf_features, hf_global_rope, linear_inv_freq
from .model import LoadedModel, ModelSourceError, UnsupportedSource
from .rope_scaling import divided_inv_freq, llama3_inv_freq, longrope_attention_factor

_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
_CHATML_END = "<|im_end|>"


def looks_like_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_hf_dir(path: Path) -> LoadedModel:
    cfg = _read_json(path / "config.json")
    config = _config(cfg, name=path.name)
    weights = _weights(path, config)
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json (a fast HF tokenizer is required)")
    tokenizer_json = tok_path.read_text(encoding="utf-8")
    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    vocab = _vocab(tokenizer_json, name=path.name)
    template = _chat_template(path, tcfg)
    bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
    bos_id = vocab.get(bos) if bos is not None else _first_id(cfg.get("bos_token_id"))
    eos_ids: list[int] = [vocab[eos]] if eos in vocab else []
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        eos_ids += _all_ids(source)
    if template and _CHATML_END in template and _CHATML_END in vocab:
        eos_ids.append(vocab[_CHATML_END])
    id_to_token = {i: t for t, i in vocab.items()}
    return LoadedModel(
        config=config, weights=weights, tokenizer_json=tokenizer_json, chat_template=template,
        bos_token_id=bos_id, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token=bos if bos is not None else id_to_token.get(bos_id),
        eos_token=eos if eos is not None else (id_to_token.get(eos_ids[0]) if eos_ids else None),
        add_bos_token=bool(tcfg.get("add_bos_token", False)), source=f"HF checkpoint {path}",
        generation_defaults=generation_defaults(gen),
    )


def generation_defaults(gen: dict[str, Any]) -> dict[str, float]:
    """generation_config.json's sampling fields; do_sample false (transformers' greedy) as temperature 0."""
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return checked({k: gen[k] for k in FIELDS if k in gen})


def _config(cfg: dict[str, Any], *, name: str) -> ModelConfig:
    model_type = cfg.get("model_type") or ""
    arch = BY_HF_TYPE.get(model_type)
    if arch is None:
        archs = ",".join(cfg.get("architectures") or []) or "unknown"
        why = KNOWN_UNSUPPORTED.get(model_type)
        raise UnsupportedSource(f"{name}: model_type {model_type!r} ({archs}{f'; {why}' if why else ''}) is not "
                                f"supported (supported: {', '.join(sorted(BY_HF_TYPE))})")
    if "vision_config" in cfg or "audio_config" in cfg:
        raise UnsupportedSource(f"{name}: a vision or audio tower is not supported")
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    # a Mistral-style window over every layer (Gemma 3's local layers are its own fields: gemma.py)
    uses_window = cfg.get("use_sliding_window", model_type in ("mistral", "phi3")) and not arch.gemma
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = hf_global_rope(cfg)
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
        rope_dims = int(head_dim * partial)
        return ModelConfig(
            architecture=arch.name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_positions=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.tied_by_default)),
            attention_bias=arch.always_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=arch.qk_norm,
            rotary_dim=rope_dims if rope_dims < head_dim else 0,
            sliding_window=int(window) if uses_window and window is not None and int(window) < max_positions else 0,
            **hf_features(cfg, arch, hidden=hidden, head_dim=head_dim),
            **_rope(cfg, rope, theta=theta, dims=rope_dims, max_positions=max_positions, name=name),
        )
    except KeyError as exc:
        raise ModelSourceError(f"{name}/config.json lacks {exc.args[0]!r}") from None
    except UnsupportedModel as exc:
        raise UnsupportedSource(f"{name}: {exc}") from None


def _rope(cfg: dict[str, Any], rope: dict[str, Any], *, theta: float, dims: int, max_positions: int,
          name: str) -> dict[str, Any]:
    """The scaled-RoPE fields of ModelConfig for config.json's rope_scaling / rope_parameters."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    original = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_positions)
    if rope_type == "default":
        return {}
    if rope_type == "linear":
        return {"rope_inv_freq": linear_inv_freq(theta, dims, float(rope["factor"]))}
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(theta, dims, factor=float(rope["factor"]),
                                   low_freq_factor=float(rope["low_freq_factor"]),
                                   high_freq_factor=float(rope["high_freq_factor"]), original_max_positions=original)
        return {"rope_inv_freq": tuple(float(f) for f in inv_freq)}
    if rope_type in ("longrope", "su"):  # "su": early Phi-3 configs' name for longrope
        short, long = (divided_inv_freq(theta, dims, np.asarray(rope[k], np.float64), name=f"{name}: {k}")
                       for k in ("short_factor", "long_factor"))
        factor = longrope_attention_factor(max_positions=max_positions, original_max_positions=original,
                                           factor=rope.get("factor"), attention_factor=rope.get("attention_factor"))
        return {"rope_inv_freq": tuple(float(f) for f in short), "rope_long_inv_freq": tuple(float(f) for f in long),
                "rope_original_max_positions": original, "rope_attention_factor": factor}
    raise UnsupportedModel(f"RoPE scaling {rope_type!r} is not supported")


def _weights(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"{path} has no *.safetensors weights")
    weights: dict[str, np.ndarray] = {}
    for file in files:
        weights.update(read_safetensors(file))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the graph reuses the embedding
    shapes = source_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ModelSourceError(f"{path.name}: missing weight {missing[0]} ({len(missing)} missing)")
    extra = [n for n in weights if n not in shapes and not n.endswith("rotary_emb.inv_freq")]
    if extra:  # e.g. an o_proj or MLP bias: a feature the graph does not have, never silently dropped
        raise UnsupportedSource(f"{path.name}: weight {extra[0]} is not part of a {config.architecture} model "
                                f"as supported ({len(extra)} such weights)")
    for n, shape in shapes.items():
        if weights[n].shape != shape:
            raise ModelSourceError(f"{path.name}: weight {n} has shape {list(weights[n].shape)}, "
                                   f"expected {list(shape)}")
    unfuse(config, weights)
    add_norm_offset(config, weights)
    return weights


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """All floating tensors of one .safetensors file as float32 arrays (bf16/fp16 widened)."""
    try:
        with open(file, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # no second copy of the file
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        base = 8 + n
    except (OSError, struct.error, ValueError, MemoryError) as exc:
        raise ModelSourceError(f"cannot read {file.name}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    out = {}
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                continue  # integer buffers and the like are not weights
            start, end = (base + int(o) for o in info["data_offsets"])
            if end > len(data):
                raise ModelSourceError(f"{file.name} is truncated (tensor {name})")
            arr = np.frombuffer(data, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize, offset=start)
            if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            out[name] = arr.astype(np.float32).reshape(info["shape"])  # a copy: detached from the mmap
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelSourceError):
            raise
        raise ModelSourceError(f"{file.name} has a malformed safetensors header") from None
    return out


def _chat_template(path: Path, tcfg: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"  # transformers >= 4.5x saves the template beside the config
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _vocab(tokenizer_json: str, *, name: str) -> dict[str, int]:
    try:
        data = json.loads(tokenizer_json)
        raw = data.get("model", {}).get("vocab") or {}
        if isinstance(raw, list):  # unigram: [[piece, score], ...]
            vocab = {piece: i for i, (piece, _score) in enumerate(raw)}
        else:
            vocab = {str(k): int(v) for k, v in raw.items()}
        for added in data.get("added_tokens") or []:
            vocab[added["content"]] = int(added["id"])
        return vocab
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ModelSourceError(f"{name}/tokenizer.json is not a valid tokenizers file") from None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot read {file}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{file} is not a JSON object")
    return data


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _first_id(value: Any) -> int | None:
    ids = _all_ids(value)
    return ids[0] if ids else None


def _all_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
