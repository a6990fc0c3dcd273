"""`staticlm serve`: open the model once, check the bind is safe, run uvicorn on the FastAPI app."""
from __future__ import annotations

import ipaddress
import socket
import sys

from staticlm.apps.models import open_model
from staticlm.errors import InvalidOption, UserError
from staticlm.runtime.options import RunOptions

from .options import LOOPBACK_HOSTS, MIN_BODY_BYTES, REASONING_FORMATS, ServeOptions


class MissingExtra(UserError):
    pass


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_serve_options(serve: ServeOptions) -> None:
    """Refuse, before the model loads, a bind that would expose the server without a key, and bad limits."""
    if not is_loopback(serve.host) and not serve.api_key:
        raise InvalidOption(f"binding {serve.host} exposes the server beyond this machine: pass --api-key KEY "
                            "(clients send it as Authorization: Bearer KEY), or bind 127.0.0.1")
    if serve.api_key is not None and not serve.api_key.strip():
        raise InvalidOption("--api-key must not be empty")
    if not 0 < serve.port < 65536:
        raise InvalidOption(f"--port must be in 1..65535, got {serve.port}")
    if serve.max_queue < 0:
        raise InvalidOption(f"--max-queue must be >= 0, got {serve.max_queue}")
    if serve.max_body_bytes is not None and serve.max_body_bytes < MIN_BODY_BYTES:
        raise InvalidOption(f"--max-body-bytes must be >= {MIN_BODY_BYTES}, got {serve.max_body_bytes}")
    for flag, value in (("--header-timeout", serve.header_timeout_s), ("--body-timeout", serve.body_timeout_s),
                        ("--send-timeout", serve.send_timeout_s)):
        if not value > 0:  # also NaN
            raise InvalidOption(f"{flag} must be > 0 seconds, got {value}")
    if serve.max_connections < 1:
        raise InvalidOption(f"--max-connections must be >= 1, got {serve.max_connections}")
    if serve.cache_dir is not None and not serve.prompt_cache:
        raise InvalidOption("--cache-dir saves the prompt cache, which --no-prompt-cache turns off: drop one")
    if serve.cache_dir is not None and serve.cache_dir.exists() and not serve.cache_dir.is_dir():
        raise InvalidOption(f"--cache-dir {serve.cache_dir} is not a directory")
    if serve.reasoning_format not in REASONING_FORMATS:
        raise InvalidOption(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}, "
                            f"got {serve.reasoning_format!r}")
    if serve.reasoning_budget < -1:
        raise InvalidOption(f"--reasoning-budget must be -1 (no limit), 0 (thinking off) or a number of tokens, "
                            f"got {serve.reasoning_budget}")


def check_port_free(serve: ServeOptions) -> None:
    """A port already taken is a one-line error before the model loads (not a uvicorn traceback after)."""
    family = socket.AF_INET6 if ":" in serve.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((serve.host, serve.port))
        except OSError as e:
            raise InvalidOption(f"cannot listen on {serve.host}:{serve.port}: {e.strerror or e}") from None


def build_server(options: RunOptions, serve: ServeOptions):
    """The model opened and the ASGI app built (not started)."""
    try:
        import fastapi  # noqa: F401
        import llguidance  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MissingExtra(f"staticlm serve needs the serve extra ({e.name} is missing): "
                           "pip install 'staticlm[serve]'") from None
    from .app import build_app
    from .state import ServeState

    check_serve_options(serve)
    model = open_model(options)
    return build_app(ServeState.build(model, serve))


def run_serve(options: RunOptions, serve: ServeOptions) -> int:
    check_serve_options(serve)
    check_port_free(serve)
    app = build_server(options, serve)
    import uvicorn

    from .protocol import guarded_protocol

    protocol = guarded_protocol(header_timeout_s=serve.header_timeout_s, max_connections=serve.max_connections,
                                body_timeout_s=serve.body_timeout_s, send_timeout_s=serve.send_timeout_s)
    print(f"staticlm serve: {app.state.model_id} on http://{serve.host}:{serve.port}/v1 (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=serve.host, port=serve.port, log_level="warning", timeout_graceful_shutdown=2,
                http=protocol, timeout_keep_alive=serve.keep_alive_s)
    return 0


__all__ = ["build_server", "check_port_free", "check_serve_options", "is_loopback", "run_serve"]
