"""`staticlm generate`: one prompt in, streamed text (or one JSON object) out; `--num-responses N` answers it N
times, decoded together in the batched graphs. `--logprobs N`, `--json-schema`, `--grammar`: what a server request
may ask (logprobs, response_format), asked through the same loop and the same grammars (apps/grammar.py)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from staticlm.apps.grammar import GrammarConstraints, Grammars
from staticlm.apps.interrupt import Interrupted, StopFlag, sigint_sets
from staticlm.apps.models import open_model
from staticlm.apps.serve.formats import chat_logprobs
from staticlm.errors import InvalidOption
from staticlm.kv_manager import Overflow
from staticlm.runtime.generate.sequence_request import MAX_TOP_LOGPROBS
from staticlm.runtime.generate.text_stream import FinishReason
from staticlm.runtime.model import Model
from staticlm.runtime.options import RunOptions
from staticlm.runtime.text.chat_template import Message
from staticlm.runtime.text.prompt_room import max_prompt_tokens


def run_generate(*, prompt: str, options: RunOptions, chat: bool = True, num_responses: int = 1,
                 as_json: bool = False, num_logprobs: int | None = None, json_schema: str | None = None,
                 grammar: str | None = None) -> dict:
    """json_schema: a schema file or the schema's JSON; grammar: a Lark grammar file or the grammar itself."""
    if not prompt.strip():
        raise InvalidOption("the prompt is empty: pass some text with --prompt")
    if num_responses < 1:
        raise InvalidOption(f"--num-responses must be >= 1, got {num_responses}")
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidOption(f"--logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {num_logprobs}")
    if num_logprobs is not None and not as_json:
        raise InvalidOption("--logprobs are printed in the --json output: add --json")
    schema = _schema(json_schema) if json_schema is not None else None  # refused before the model opens
    lark = _grammar_text(grammar) if grammar is not None else None
    model = open_model(options, num_responses=num_responses)
    request = {"num_logprobs": num_logprobs, "constraint": _constraint(model, schema=schema, lark=lark)}
    if num_responses == 1:
        summary, cancelled = _generate_one(model, prompt, chat=chat, as_json=as_json, request=request)
    else:
        ids = (model.format.prompt_ids([Message(role="user", content=prompt)],
                                       system_prompt=options.system_prompt_or_none)
               if chat else model.tokenizer.encode(prompt, add_special_tokens=True))
        summary, cancelled = _generate_batch(model, ids, num_responses=num_responses, as_json=as_json,
                                             request=request)
    if as_json:
        print(json.dumps(summary))
    if cancelled:
        raise Interrupted("interrupted: generation stopped by Ctrl-C")
    return summary


def _schema(value: str) -> dict:
    """--json-schema's schema: the JSON itself (it starts with "{" or "["), or a file holding it."""
    text = value if value.lstrip().startswith(("{", "[")) else _read(value, flag="--json-schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidOption(f"--json-schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidOption(f"--json-schema: a schema is a JSON object, got {type(schema).__name__}")
    return schema


def _grammar_text(value: str) -> str:
    """--grammar's Lark text: a file's, or the grammar itself (any Lark rule has a ':')."""
    return _read(value, flag="--grammar") if Path(value).is_file() or ":" not in value else value


def _read(path: str, *, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidOption(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _constraint(model: Model, *, schema: dict | None, lark: str | None) -> GrammarConstraints | None:
    if schema is None and lark is None:
        return None
    grammars = Grammars.for_model(model)
    return grammars.json_schema(schema, param="--json-schema") if schema is not None else grammars.lark(
        lark, param="--grammar")


def _generate_one(model: Model, prompt: str, *, chat: bool, as_json: bool, request: dict) -> tuple[dict, bool]:
    engine, session, flag = model.engine, model.chat(), StopFlag()
    params = model.default_params()
    if chat:
        stream = session.send(prompt, params, should_stop=flag, **request)
    else:
        ids, num_dropped = model.tokenizer.encode(prompt, add_special_tokens=True), 0
        if len(ids) > engine.max_context and model.options.overflow is Overflow.SLIDE:  # keep the end
            num_dropped = len(ids) - max_prompt_tokens(max_context=engine.max_context,
                                                       max_new_tokens=params.max_new_tokens)
            ids = ids[num_dropped:]
        stream = model.stream(ids, params, should_stop=flag, **request)
    with sigint_sets(flag):
        for chunk in stream:
            if not as_json:
                sys.stdout.write(chunk)
                sys.stdout.flush()
    if not as_json:
        sys.stdout.write("\n")
    num_dropped = session.prompt_tokens_dropped if chat else num_dropped
    if num_dropped:
        print(f"staticlm: the prompt was longer than the context ({engine.max_context} tokens): its first "
              f"{num_dropped} tokens were left out" + (" (the chat template's head stays)" if chat else ""),
              file=sys.stderr)
    result = model.last_result
    summary = {
        "token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason.value,
        "prompt_tokens": result.prompt_tokens, "prompt_tokens_dropped": num_dropped,
        "new_tokens": len(result.token_ids),
        "ttft_s": round(result.ttft_s, 4), "prefill_tok_s": round(result.prefill_tok_s, 2),
        "decode_tok_s": round(result.decode_tok_s, 2), "device": engine.device_name,
        "kv_strategy": engine.kv_strategy.value, "kv_copied_bytes": int(engine.kv.stats.copied_bytes),
    }
    if request["num_logprobs"] is not None:  # the OpenAI chat shape, token by token (apps/serve/formats.py)
        summary["logprobs"] = chat_logprobs(model.tokenizer, result.logprobs)["content"]
    spec = model.generator.speculator
    if spec is not None:
        summary.update(drafted_tokens=spec.stats.num_drafted, accepted_tokens=spec.stats.num_accepted,
                       verify_steps=spec.stats.num_steps, acceptance_rate=round(spec.stats.acceptance_rate, 3),
                       verify_rows=engine.counters.num_verify_rows)
    return summary, result.finish_reason is FinishReason.CANCELLED


def _generate_batch(model: Model, ids: list[int], *, num_responses: int, as_json: bool,
                    request: dict) -> tuple[dict, bool]:
    flag = StopFlag()
    rows = model.loop.rows
    t0 = time.perf_counter()
    with sigint_sets(flag):
        responses = model.generate_many(ids, model.default_params(), num_responses=num_responses,
                                        should_stop=flag, **request)
    seconds = time.perf_counter() - t0
    num_tokens = sum(len(r.token_ids) for r in responses)
    summary = {
        "responses": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason.value,
                       "first_token_s": round(r.first_token_s, 4), "last_token_s": round(r.last_token_s, 4)}
                      for r in responses],
        "prompt_tokens": len(ids), "new_tokens": num_tokens, "total_tok_s": round(num_tokens / seconds, 2),
        "first_response_s": round(min(r.last_token_s for r in responses), 4),
        "mean_response_s": round(sum(r.last_token_s for r in responses) / len(responses), 4),
        "device": model.engine.device_name, "kv_copied_bytes": rows.copied_bytes, "kv_bytes": rows.kv_bytes,
        "rows": rows.kind,
    }
    if request["num_logprobs"] is not None:
        for out, r in zip(summary["responses"], responses, strict=True):
            out["logprobs"] = chat_logprobs(model.tokenizer, r.logprobs)["content"]
    speculator = rows.speculator
    if speculator is not None:
        counters = rows.engine.counters
        summary.update(drafted_tokens=speculator.stats.num_drafted, accepted_tokens=speculator.stats.num_accepted,
                       verify_steps=speculator.stats.num_steps, decode_steps=counters.num_decode_steps,
                       acceptance_rate=round(speculator.stats.acceptance_rate, 3),
                       verify_rows=counters.num_verify_rows, verify_real_rows=counters.num_verify_tokens)
    if not as_json:
        for i, r in sorted(enumerate(responses), key=lambda ir: ir[1].last_token_s):
            sys.stdout.write(f"--- response {i + 1} ({r.last_token_s:.1f} s, {r.finish_reason.value}) ---\n{r.text}\n")
    return summary, any(r.finish_reason is FinishReason.CANCELLED for r in responses)
