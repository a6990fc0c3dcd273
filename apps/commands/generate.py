"""`staticlm generate`: one prompt in, streamed text (or one JSON object) out."""
from __future__ import annotations

import json
import sys

from staticlm.apps.common import RunOptions, open_chat, open_engine
from staticlm.apps.interrupt import StopFlag, sigint_sets
from staticlm.runtime.chat import ChatSession
from staticlm.runtime.generator import FinishReason, GenerationParams


class Interrupted(Exception):
    """Ctrl-C stopped the generation; the partial output was already printed."""


def run_generate(*, prompt: str, run: RunOptions, params: GenerationParams, chat: bool = True,
                 system_prompt: str | None = None, as_json: bool = False) -> dict:
    if not prompt.strip():
        raise ValueError("the prompt is empty: pass some text with --prompt")
    engine = open_engine(run)
    session: ChatSession = open_chat(engine, system_prompt=system_prompt, run=run)
    if chat:
        stream = session.send(prompt, params, should_stop=(flag := StopFlag()))
    else:
        ids = session.generator.tokenizer.encode(prompt, add_special_tokens=True)
        stream = session.generator.stream(ids, params, should_stop=(flag := StopFlag()))
    with sigint_sets(flag):
        for chunk in stream:
            if not as_json:
                sys.stdout.write(chunk)
                sys.stdout.flush()
    result = session.generator.last_result
    summary = {
        "token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason.value,
        "prompt_tokens": result.prompt_tokens, "new_tokens": len(result.token_ids),
        "ttft_s": round(result.ttft_s, 4), "prefill_tok_s": round(result.prefill_tok_s, 2),
        "decode_tok_s": round(result.decode_tok_s, 2), "device": engine.device_name,
        "kv_strategy": run.kv_strategy, "kv_copied_bytes": int(engine.kv.stats.copied_bytes),
    }
    spec = session.generator.speculator
    if spec is not None:
        summary.update(drafted_tokens=spec.stats.num_drafted, accepted_tokens=spec.stats.num_accepted,
                       verify_steps=spec.stats.num_steps, acceptance_rate=round(spec.stats.acceptance_rate, 3),
                       verify_rows=engine.counters.num_verify_rows)
    if as_json:
        print(json.dumps(summary))
    else:
        sys.stdout.write("\n")
    if result.finish_reason is FinishReason.CANCELLED:
        raise Interrupted("interrupted: generation stopped by Ctrl-C")
    return summary
