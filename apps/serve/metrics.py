"""`/metrics` in Prometheus text: requests, tokens in and out, TTFT and per-token latency, KV rows, prompt cache."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from staticlm.runtime.generate.loop import GenerationLoop

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """One registry per server (tests may run several in a process)."""

    def __init__(self, generation_loop: GenerationLoop) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("staticlm_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.client_aborts = Counter("staticlm_client_aborts", "requests whose client left before the answer "
                                     "(mid-body or while it was computed)", registry=r)
        self.client_errors = Counter("staticlm_client_errors", "requests refused for what the client sent (a 4xx "
                                     "answer, or an error event in a stream, a client abort not counted)", registry=r)
        self.server_errors = Counter("staticlm_server_errors", "requests that failed on the server's side (a 5xx "
                                     "answer, or an error event in a stream)", registry=r)
        self.prompt_tokens = Counter("staticlm_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("staticlm_prompt_cached_tokens", "prompt tokens the prompt cache held",
                                     registry=r)
        self.completion_tokens = Counter("staticlm_completion_tokens", "tokens generated", registry=r)
        self.cache_hits = Counter("staticlm_prompt_cache_hits", "requests that reused cached prompt tokens",
                                  registry=r)
        self.ttft = Histogram("staticlm_time_to_first_token_seconds", "request received to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.token_latency = Histogram("staticlm_token_latency_seconds", "time between a choice's tokens",
                                       buckets=LATENCY_BUCKETS, registry=r)
        status = generation_loop.status
        for name, key, doc in (("staticlm_kv_rows", "rows", "batch rows (KV sequences) the server decodes in"),
                               ("staticlm_kv_rows_in_use", "rows_in_use", "batch rows decoding a request now"),
                               ("staticlm_kv_bytes", "kv_bytes", "bytes of KV buffers held (prefill and batch rows)"),
                               ("staticlm_queue_length", "waiting", "requests waiting for a row"),
                               ("staticlm_prompt_cache_rows", "cached_rows", "free rows holding a cached prefix"),
                               ("staticlm_cancelled_choices", "cancelled", "choices ended by a client that left")):
            Gauge(name, doc, registry=r).set_function(lambda key=key: status()[key])

    def count_error(self, status: int) -> None:
        """An answer's status, or a streamed error's: counted as the client's error or the server's."""
        if status >= 500:
            self.server_errors.inc()
        elif 400 <= status < 499:  # (499: the client left, counted as a client abort)
            self.client_errors.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServeMetrics"]
