"""The JSON the OpenAI API answers with: chat.completion(.chunk), text_completion, usage, logprobs, SSE lines."""
from __future__ import annotations

import json
from typing import Any

from staticlm.runtime.generate.sequence_request import TokenLogprob
from staticlm.runtime.generate.text_stream import FinishReason
from staticlm.runtime.text.tokenizer import Tokenizer

FINISH = {FinishReason.EOS: "stop", FinishReason.STOP_STRING: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "stop"}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(*, prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for it in items:
        text, raw = _token(tokenizer, it.token_id)
        top = []
        for tid, lp in it.top:
            t, b = _token(tokenizer, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": it.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob], *, offset: int) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (one dict per token), text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for it in items:
        text, _ = _token(tokenizer, it.token_id)
        tokens.append(text)
        lps.append(it.logprob)
        tops.append({_token(tokenizer, tid)[0]: lp for tid, lp in it.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(*, rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def completion_chunk(*, rid: str, created: int, model: str, index: int, text: str, finish: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(*, rid: str, created: int, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


__all__ = ["FINISH", "chat_chunk", "chat_logprobs", "completion_chunk", "completion_logprobs", "sse", "usage",
           "usage_chunk"]
