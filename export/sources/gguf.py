"""Load a GGUF file (llama.cpp layout) of a declared architecture (architectures.py) into HF-named float32 weights.

Everything that can be refused is refused from the header, before a tensor's data is read: the architecture and
its options first, then every tensor's presence, type and shape against the config (`check_tensors`).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType

from staticlm.runtime.family.config import ModelConfig, UnsupportedModel
from staticlm.runtime.family.generation_defaults import checked

from .architectures import BY_GGUF_NAME, BY_NAME, KNOWN_UNSUPPORTED, Architecture, source_shapes, supported_names
from .architectures import unfuse as unfuse_tensors
from .gemma import gguf_features, linear_inv_freq, refuse_softcapping
from .gguf_file import GGUFFile, LazyTensors, peek_architecture
from .gguf_grids import FLOAT_TYPES, GRID_TYPES, FloatWeight, WeightGrid
from .gguf_tokenizer import build_tokenizer
from .model import LoadedModel, ModelSourceError, UnsupportedSource, required_weight_names
from .rope_scaling import divided_inv_freq, longrope_attention_factor

# The types gguf can dequantize (its registry is private: without it, an unreadable type fails when read).
_DEQUANTIZABLE = getattr(gguf.quants, "_type_traits", None)
_FLOATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F64}
# llama.cpp tensors besides the weights: the RoPE factors, read into the config.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def load_gguf(path: Path, *, source: str | None = None) -> LoadedModel:
    peeked = peek_architecture(path)  # refused from the header's first keys, before the reader parses it all
    if peeked is not None:
        _declared(peeked, file_name=Path(path).name)
    gf = GGUFFile(path)
    arch = architecture(gf)
    try:
        config = _config(gf.metadata, gf, arch=arch)
    except UnsupportedModel as exc:
        raise UnsupportedSource(f"{path.name}: {exc}") from None
    check_tensors(gf, config)
    tokenizer = build_tokenizer(gf.metadata, name=path.name)
    weights, grids, requantized = _weights(gf, config)
    unfuse_tensors(config, weights)
    unfuse_tensors(config, grids)
    return LoadedModel(
        config=config, weights=weights, tokenizer_json=tokenizer.tokenizer_json,
        chat_template=({"default": tokenizer.chat_template, **tokenizer.chat_templates}
                       if tokenizer.chat_templates and tokenizer.chat_template else tokenizer.chat_template),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
        add_bos_token=tokenizer.add_bos_token, source=source or f"GGUF {path}", grids=grids,
        requantized=tuple(requantized), source_types={n: i.qtype.name for n, i in gf.tensors.items()},
        drop_pages=gf.drop_pages, generation_defaults=generation_defaults(gf.metadata),
    )


# llama.cpp's general.sampling.* keys (gguf-py's Keys.General.SAMPLING_*) -> generation_defaults.py's fields
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def generation_defaults(metadata: dict) -> dict[str, float]:
    """The file's own sampling defaults, where its metadata carries them."""
    return checked({field: metadata[key] for key, field in SAMPLING_KEYS.items() if key in metadata})


def architecture(gf: GGUFFile) -> Architecture:
    """The declared architecture of the file's `general.architecture`, or a one-line refusal naming it."""
    return _declared(gf.metadata.get("general.architecture"), file_name=gf.path.name)


def _declared(name: object, *, file_name: str) -> Architecture:
    if name not in BY_GGUF_NAME:
        why = KNOWN_UNSUPPORTED.get(str(name))
        raise UnsupportedSource(f"{file_name}: GGUF architecture {name!r}{f' ({why})' if why else ''} is not "
                                f"supported (supported: {supported_names()})")
    return BY_GGUF_NAME[name]


def check_tensors(gf: GGUFFile, config: ModelConfig) -> None:
    """Every tensor the config needs is present, of a type we can read, of its shape; no tensor is left over that
    would carry a feature the graph does not have. Reads tensor infos only (no data)."""
    arch, name = BY_NAME[config.architecture], gf.path.name
    want = source_shapes(config)
    found: set[str] = set()
    for tensor, info in gf.tensors.items():
        hf = arch.gguf_hf_name(tensor)
        if hf is None or hf not in want:
            if tensor in _ROPE_TENSORS:
                continue
            raise UnsupportedSource(f"{name}: tensor {tensor} is not part of a {arch.name} model as supported")
        if info.qtype not in _FLOATS and _DEQUANTIZABLE is not None and info.qtype not in _DEQUANTIZABLE:
            raise UnsupportedSource(f"{name}: tensor {tensor} has type {info.qtype.name}, which cannot be read")
        if tuple(info.shape) != want[hf]:
            raise ModelSourceError(f"{name}: tensor {tensor} has shape {list(info.shape)}, expected {list(want[hf])}")
        found.add(hf)
    missing = [n for n in want if n not in found]
    if missing:
        raise ModelSourceError(f"{name}: missing tensor for {missing[0]} ({len(missing)} missing)")


def _config(meta: dict[str, Any], gf: GGUFFile, *, arch: Architecture) -> ModelConfig:
    key = arch.gguf_name

    def need(k: str) -> Any:
        full = f"{key}.{k}"
        if full not in meta:
            raise ModelSourceError(f"{gf.path.name}: GGUF metadata lacks {full}")
        return meta[full]

    refuse_softcapping(lambda option: meta.get(f"{key}.{option}"))
    if "token_embd.weight" not in gf.tensors:
        raise ModelSourceError(f"{gf.path.name}: GGUF has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{key}.attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{key}.rope.dimension_count", head_dim))
    if rope_dims != head_dim and arch.gguf_qk_permuted:
        raise UnsupportedModel(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported for {arch.name}")
    max_positions = int(need("context_length"))
    window = int(meta.get(f"{key}.attention.sliding_window") or 0)
    theta = _f32(meta.get(f"{key}.rope.freq_base", 10000.0))
    num_layers = int(need("block_count"))
    features = (gguf_features(meta, key=key, hidden=hidden, heads=heads, head_dim=head_dim, num_layers=num_layers)
                if arch.gemma else {})  # Gemma 3 (gemma.py)
    return ModelConfig(
        architecture=arch.name,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{key}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        # The embedding's rows are what the graph indexes; the token list may be padded or short.
        vocab_size=gf.tensors["token_embd.weight"].shape[0],
        rope_theta=theta,
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        max_positions=max_positions,
        tie_word_embeddings="output.weight" not in gf.tensors,  # llama.cpp omits output when tied
        attention_bias=arch.always_bias or "blk.0.attn_q.bias" in gf.tensors,
        qk_norm=arch.qk_norm,
        rotary_dim=rope_dims if rope_dims < head_dim else 0,
        sliding_window=window if 0 < window < max_positions and not features else 0,
        **features,
        **_rope(meta, gf, key=key, theta=theta, dims=rope_dims, max_positions=max_positions),
    )


def _rope(meta: dict[str, Any], gf: GGUFFile, *, key: str, theta: float, dims: int, max_positions: int) -> dict:
    """The scaled-RoPE fields: llama3 arrives as `rope_freqs` (per-pair divisors), longrope as the short/long
    factor tensors; llama.cpp's linear/yarn scaling types are refused."""
    scaling = meta.get(f"{key}.rope.scaling.type")
    if scaling not in (None, "none", "longrope", "llama3", "linear"):
        raise UnsupportedModel(f"RoPE scaling {scaling!r} is not supported")
    name = gf.path.name
    if scaling == "linear":  # Gemma 3 4B+: the global layers' frequencies divided by the factor
        factor = meta.get(f"{key}.rope.scaling.factor")
        if factor is None:
            raise UnsupportedModel("RoPE scaling 'linear' without its factor is not supported")
        return {"rope_inv_freq": linear_inv_freq(theta, dims, _f32(factor))}
    if "rope_freqs.weight" in gf.tensors:
        return {"rope_inv_freq": _floats(divided_inv_freq(theta, dims, gf.tensor("rope_freqs.weight"), name=name))}
    if "rope_factors_long.weight" in gf.tensors and "rope_factors_short.weight" in gf.tensors:
        original = int(meta.get(f"{key}.rope.scaling.original_context_length", max_positions))
        factor = meta.get(f"{key}.rope.scaling.attn_factor")
        return {
            "rope_inv_freq": _floats(divided_inv_freq(theta, dims, gf.tensor("rope_factors_short.weight"), name=name)),
            "rope_long_inv_freq": _floats(divided_inv_freq(theta, dims, gf.tensor("rope_factors_long.weight"),
                                                           name=name)),
            "rope_original_max_positions": original,
            "rope_attention_factor": longrope_attention_factor(
                max_positions=max_positions, original_max_positions=original,
                attention_factor=None if factor is None else _f32(factor)),
        }
    if scaling in ("longrope", "llama3"):
        raise UnsupportedModel(f"RoPE scaling {scaling!r} without its factor tensors is not supported")
    return {}


def _permuted_heads(name: str, config: ModelConfig) -> int | None:
    """The head count to undo llama.cpp's q/k row permutation over, for a permuted architecture's q/k tensor."""
    if not BY_NAME[config.architecture].gguf_qk_permuted:
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    return config.num_kv_heads if name.endswith(("attn_k.weight", "attn_k.bias")) else None


def _floats(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _weights(gf: GGUFFile, config: ModelConfig) -> tuple[LazyTensors, LazyTensors, list[str]]:
    """HF-named float32 weights (gguf's dequantization), the exact grids of the matrices that have one
    (gguf_grids.py), both made from the mapped file when read, and "name (TYPE)" of each quantized tensor with no
    exact form. Reads tensor infos only."""
    weights: dict[str, Callable[[], np.ndarray]] = {}
    grids: dict[str, Callable[[], WeightGrid | FloatWeight]] = {}
    requantized: list[str] = []
    for name, info in gf.tensors.items():
        hf = _hf_name(name, config)
        if hf is None:
            continue  # e.g. rope_freqs: read into the config
        heads = _permuted_heads(name, config)
        rows = None if heads is None else _unpermute(np.arange(info.shape[0]), heads)
        weights[hf] = partial(_float_tensor, gf, name, rows)
        if info.qtype in GRID_TYPES and len(info.shape) == 2:
            grids[hf] = partial(_grid, gf, name, rows)
        elif info.qtype in FLOAT_TYPES:
            if len(info.shape) == 2:  # a float matrix is its own exact grid
                grids[hf] = partial(lambda w, qtype: FloatWeight(qtype=qtype, values=w()), weights[hf],
                                    info.qtype.name)
        else:
            requantized.append(f"{hf} ({info.qtype.name})")
    missing = [n for n in required_weight_names(config) if n not in weights]
    if missing:
        raise ModelSourceError(f"{gf.path.name}: missing tensor for {missing[0]} ({len(missing)} missing)")
    return LazyTensors(weights), LazyTensors(grids), requantized


def _float_tensor(gf: GGUFFile, name: str, rows: np.ndarray | None) -> np.ndarray:
    """gguf's dequantization, llama.cpp's q/k row order undone (rows: the HF order of its rows)."""
    w = gf.tensor(name)
    return w if rows is None else np.ascontiguousarray(w[rows])


def _grid(gf: GGUFFile, name: str, rows: np.ndarray | None) -> WeightGrid:
    grid = gf.grid(name)
    return grid if rows is None else grid.rows(rows)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `permute`), as transformers does.

    llama.cpp interleaves the two rotary halves of each head ([x0, x_{d/2}, x1, ...]) for its
    RoPE kernel; HF's rotate_half wants them as two contiguous halves.
    """
    dim1 = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, dim1 // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape))


def _f32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999975e-06. Keep its shortest float32 spelling."""
    return float(str(np.float32(value)))


def _hf_name(name: str, config: ModelConfig) -> str | None:
    return BY_NAME[config.architecture].gguf_hf_name(name)
