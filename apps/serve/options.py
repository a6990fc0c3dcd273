"""What `staticlm serve` adds to the run options: where it listens, who may call it, how much it queues."""
from __future__ import annotations

from dataclasses import dataclass

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # allowed origins; none: CORS off
    max_queue: int = 16  # requests that may wait for a batch row; past it: 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # past it: 413
    prompt_cache: bool = True
    model_id: str | None = None  # default: the model directory's name


__all__ = ["DEFAULT_MAX_BODY_BYTES", "LOOPBACK_HOSTS", "ServeOptions"]
