"""Callers that drive the generation loop from their own thread: one answer streamed (generate, chat, the app),
or several answers to one prompt (`--num-responses`). Each submits requests and steps the loop until they end;
a server steps it from its engine thread instead (apps/serve/worker.py)."""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from staticlm.errors import InvalidOption
from staticlm.runtime.generate.loop import GenerationLoop
from staticlm.runtime.generate.sequence_request import (
    Admitted,
    Constraint,
    Delta,
    Event,
    Failed,
    Finished,
    SequenceRequest,
    TokenLogprob,
)
from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int  # tokens prefilled for this request (the cached prefix is not counted)
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for


@dataclass
class Response:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    first_token_s: float  # since the request started
    last_token_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for


def _run(loop: GenerationLoop, requests: list[SequenceRequest], *, first_index: list[int],
         should_stop: Callable[[], bool]) -> Iterator[tuple[int, Event]]:
    """Step the loop until every choice of the requests has finished, yielding (index, event) as they come: a
    request's choice c is answer first_index[request] + c."""
    events: deque[tuple[int, Event]] = deque()
    for request, base in zip(requests, first_index, strict=True):
        request.on_event = lambda event, base=base: events.append((base, event))
    num_open = sum(r.num_choices for r in requests)
    try:
        for request in requests:
            loop.submit(request)
        while num_open:
            if should_stop():
                for request in requests:
                    request.cancel()
            loop.step()
            while events:
                base, event = events.popleft()
                if isinstance(event, Failed):
                    raise event.error
                num_open -= isinstance(event, Finished)
                yield base, event
    except BaseException:  # Ctrl-C, a failure, or the caller stopped reading: the rows are freed now
        for request in requests:
            request.cancel()
        with contextlib.suppress(Exception):  # the error that got here is the one to report
            loop.step()
        raise


def stream(loop: GenerationLoop, prompt_ids: list[int], params: GenerationParams, *,
           should_stop: Callable[[], bool] = lambda: False, num_logprobs: int | None = None,
           constraint: Callable[[], Constraint] | None = None,
           on_result: Callable[[GenerationResult], None] = lambda result: None) -> Iterator[str]:
    """One answer's text as it comes; on_result gets the summary at the end."""
    if not prompt_ids:
        raise InvalidOption("the prompt is empty")
    request = SequenceRequest(prompt_ids=list(prompt_ids), params=params, on_event=lambda event: None,
                              num_logprobs=num_logprobs, constraint=constraint)
    t0 = time.perf_counter()
    prefilled, logprobs = len(prompt_ids), []
    for _, event in _run(loop, [request], first_index=[0], should_stop=should_stop):
        if isinstance(event, Admitted):
            prefilled = event.num_prompt_tokens - event.num_cached_tokens
        elif isinstance(event, Delta):
            logprobs += event.logprobs
            if event.text:
                yield event.text
        elif isinstance(event, Finished):
            first = event.first_time or event.time
            num_decoded = max(len(event.token_ids) - 1, 0)
            on_result(GenerationResult(
                token_ids=list(event.token_ids), text=event.text, finish_reason=event.reason,
                prompt_tokens=prefilled, ttft_s=(first - t0) if event.token_ids else 0.0,
                # the prompt's uncached tokens over the time to the first token (which their prefill ends in)
                prefill_tok_s=prefilled / (first - t0) if event.token_ids and first > t0 else 0.0,
                decode_tok_s=num_decoded / (event.time - first) if event.time > first else 0.0, logprobs=logprobs))


def generate_many(loop: GenerationLoop, prompt_ids: list[int], params: GenerationParams, *, num_responses: int,
                  on_text: Callable[[int, str], None] = lambda index, text: None,
                  should_stop: Callable[[], bool] = lambda: False, num_logprobs: int | None = None,
                  constraint: Callable[[], Constraint] | None = None) -> list[Response]:
    """num_responses answers to one prompt, as many at once as the loop has rows (the prompt is prefilled once:
    the later requests find it in a row); num_logprobs, constraint: as for stream, for every answer."""
    if num_responses < 1:
        raise InvalidOption(f"--num-responses must be >= 1, got {num_responses}")
    if not prompt_ids:
        raise InvalidOption("the prompt is empty")
    sizes = [min(loop.num_rows, num_responses - i) for i in range(0, num_responses, loop.num_rows)]
    requests = [SequenceRequest(prompt_ids=list(prompt_ids), params=params, on_event=lambda event: None,
                                num_choices=n, num_logprobs=num_logprobs, constraint=constraint) for n in sizes]
    first_index = [sum(sizes[:i]) for i in range(len(sizes))]
    t0 = time.perf_counter()
    out: list[Response | None] = [None] * num_responses
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(num_responses)]
    for base, event in _run(loop, requests, first_index=first_index, should_stop=should_stop):
        if isinstance(event, Delta):
            logprobs[base + event.choice] += event.logprobs
            if event.text:
                on_text(base + event.choice, event.text)
        elif isinstance(event, Finished):
            first = event.first_time or event.time
            out[base + event.choice] = Response(token_ids=list(event.token_ids), text=event.text,
                                                finish_reason=event.reason, first_token_s=first - t0,
                                                last_token_s=event.time - t0, logprobs=logprobs[base + event.choice])
    return [r for r in out if r is not None]


__all__ = ["GenerationResult", "Response", "generate_many", "stream"]
