"""What `staticlm serve` adds to the run options: where it listens, who may call it, how much it takes, how long
it waits for a client, and what it does with a reasoning model's thoughts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
# A body holds the prompt's text, JSON-escaped (up to 6 bytes a character, "\u00e9"), and characters run a few
# to a token: 32 bytes per context token leaves room for that; tools and schemas get a fixed allowance on top.
BODY_BYTES_PER_TOKEN = 32
BODY_BYTES_EXTRA = 64 << 10
MIN_BODY_BYTES = 1024
REASONING_FORMATS = ("auto", "deepseek", "none")


def default_max_body_bytes(max_context: int) -> int:
    """The body cap that matches the context: a body past it cannot hold a prompt that fits."""
    return max_context * BODY_BYTES_PER_TOKEN + BODY_BYTES_EXTRA


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # allowed origins; none: CORS off, and a browser Origin is refused
    max_queue: int = 16  # requests that may wait for a batch row; past it: 429
    max_body_bytes: int | None = None  # past it: 413 (None: default_max_body_bytes of the model's context)
    prompt_cache: bool = True
    cache_dir: Path | None = None  # the prompt cache saved here when idle and at exit, loaded at start (slots.py)
    model_id: str | None = None  # default: the model directory's name
    header_timeout_s: float = 10.0  # a connection's request headers must be complete within this
    body_timeout_s: float = 60.0  # a request's body must be complete within this of its headers (past it: 408)
    send_timeout_s: float = 30.0  # a client that reads none of its answer for this long is dropped (its rows freed)
    max_connections: int = 128  # open connections; past it, a new one is closed at once
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    reasoning_format: str = "auto"  # auto/deepseek: <think> text goes to reasoning_content; none: left in content
    reasoning_budget: int = -1  # reasoning tokens before </think> is forced (-1: no limit, 0: thinking off)


__all__ = ["BODY_BYTES_EXTRA", "BODY_BYTES_PER_TOKEN", "LOOPBACK_HOSTS", "MIN_BODY_BYTES", "REASONING_FORMATS",
           "ServeOptions", "default_max_body_bytes"]
