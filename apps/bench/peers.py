"""The peers: which are installed, the models they need (made once, cached), and one worker process each.

Every peer runs the same weights as ours: the default model's GGUF. llama.cpp reads it as is; transformers,
optimum and onnxruntime-genai's builder need a Hugging Face checkpoint, which transformers makes from the
GGUF (dequantized, so the builder quantizes the same values ours did). Models live under
~/.cache/staticlm/peers and are built on first use only.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .base import Peer

PEER_CACHE_ENV = "STATICLM_PEERS"
OPTIMUM_PYTHON_ENV = "STATICLM_OPTIMUM_PYTHON"  # an interpreter of a separate venv with optimum-onnx
WORKER = Path(__file__).with_name("worker.py")
# What each peer imports; a missing one means "not installed" and a one-line skip.
PEER_MODULES = {Peer.GENAI: ("onnxruntime_genai", "transformers", "torch"), Peer.LLAMACPP: ("llama_cpp",),
                Peer.OPTIMUM: ("optimum.onnxruntime", "transformers", "torch"),
                Peer.TRANSFORMERS: ("transformers", "torch")}
INSTALL_HINT = {Peer.GENAI: "pip install 'staticlm[bench]' (and torch + transformers for its builder: '.[dev]')",
                Peer.LLAMACPP: "pip install llama-cpp-python (a ~10-minute native build; see README, Benchmarks)",
                Peer.OPTIMUM: f"optimum-onnx pins transformers<4.58: install it in a separate venv "
                              f"(~/.cache/staticlm/peers/optimum-venv, or point {OPTIMUM_PYTHON_ENV} at its python; "
                              f"see README, Benchmarks)",
                Peer.TRANSFORMERS: "pip install torch==2.13.0 transformers accelerate (the '.[dev]' extra)"}


class PeerUnavailable(Exception):
    """A peer cannot run here; the message is the one-line reason shown in the report."""


@dataclass(frozen=True)
class PeerModel:
    python: str  # the interpreter that runs the worker
    model: str  # what the worker loads: a directory or the GGUF file
    worker: Path = WORKER  # the worker script (a baseline revision's own, baseline.py)
    pythonpath: str | None = None  # put first on the worker's PYTHONPATH (a baseline revision's tree)
    system: str | None = None  # the worker's system when it is not the row's name (staticlm@REV runs "staticlm")


def peer_cache() -> Path:
    env = os.environ.get(PEER_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "staticlm" / "peers"


def _has_modules(names: tuple[str, ...]) -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in names)
    except ModuleNotFoundError:  # find_spec of "a.b" imports "a"
        return False


def _python_has(python: str, names: tuple[str, ...]) -> bool:
    code = "import importlib.util,sys; sys.exit(0 if all(importlib.util.find_spec(n) for n in sys.argv[1:]) else 1)"
    try:
        return subprocess.run([python, "-c", code, *names], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _run_logged(cmd: list[str], *, what: str, log) -> None:
    log(f"  building {what} (once; cached under {peer_cache()}) ...")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"building {what} failed: {tail[0][:200]}")


def hf_checkpoint(gguf: Path, *, log) -> Path:
    """A float Hugging Face checkpoint of the GGUF (transformers dequantizes it; torch only in a child)."""
    out = peer_cache() / f"{gguf.stem}-hf"
    if not (out / "config.json").is_file():
        if not _has_modules(("transformers", "torch")):
            raise PeerUnavailable("needs a Hugging Face checkpoint, made by transformers + torch (not installed)")
        _run_logged([sys.executable, "-m", "staticlm.apps.bench.peer_hf", str(gguf), str(out)],
                    what="a Hugging Face checkpoint from the GGUF", log=log)
    return out


def genai_model(hf_dir: Path, *, log) -> Path:
    """onnxruntime-genai's own int4 CPU model, made by its builder from the same weights."""
    out = peer_cache() / f"{hf_dir.name.removesuffix('-hf')}-genai-int4-cpu"
    if not (out / "genai_config.json").is_file():
        _run_logged([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                     "-p", "int4", "-e", "cpu", "-c", str(peer_cache() / "genai-build-cache")],
                    what="the onnxruntime-genai int4 CPU model", log=log)
    return out


def prepare(peer: Peer, *, gguf: Path, log) -> PeerModel:
    """The interpreter and model a peer runs with, or PeerUnavailable (not installed, cannot build)."""
    python = sys.executable
    if peer is Peer.OPTIMUM and not _has_modules(PEER_MODULES[peer]):
        # Its own venv: named by the environment, or the conventional one beside the peer models.
        python = os.environ.get(OPTIMUM_PYTHON_ENV, "") or str(peer_cache() / "optimum-venv" / "bin" / "python")
        if not os.path.isfile(python) or not _python_has(python, PEER_MODULES[peer]):
            raise PeerUnavailable(f"not installed: {INSTALL_HINT[peer]}")
    elif not _has_modules(PEER_MODULES[peer]):
        raise PeerUnavailable(f"not installed: {INSTALL_HINT[peer]}")
    if not gguf.is_file():
        raise PeerUnavailable(f"the model's GGUF {gguf} is missing")
    if peer is Peer.LLAMACPP:
        return PeerModel(python, str(gguf))
    hf = hf_checkpoint(gguf, log=log)
    if peer is Peer.GENAI:
        return PeerModel(python, str(genai_model(hf, log=log)))
    return PeerModel(python, str(hf))


def run_worker(system: str, model: PeerModel, *, workload: dict, timeout_s: float = 3600,
               task: str = "speed") -> dict:
    """Run model's worker for one system and task (speed, memory); its JSON result, or PeerUnavailable with the
    error's last line."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
        path = f.name
    try:
        # The peer's own environment, minus anything that would change its thread count behind our back.
        env = {**os.environ, "OMP_NUM_THREADS": str(workload["threads"]),
               "MKL_NUM_THREADS": str(workload["threads"]), "TOKENIZERS_PARALLELISM": "false"}
        if model.pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [model.pythonpath, env.get("PYTHONPATH")]))
        done = subprocess.run([model.python, str(model.worker), model.system or system, path, task],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{system} did not finish within {timeout_s:.0f} s") from None
    finally:
        os.unlink(path)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"{system} failed: {tail[0][:300]}")
    return json.loads(lines[-1])
