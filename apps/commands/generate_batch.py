"""`staticlm generate --num-responses N`: several answers to one prompt, decoded together."""
from __future__ import annotations

import json
import sys
import time

from staticlm.apps.common import RunOptions, open_chat, open_engine
from staticlm.apps.interrupt import StopFlag, sigint_sets
from staticlm.runtime.batch import BatchGenerator
from staticlm.runtime.chat_template import Message
from staticlm.runtime.generator import FinishReason, GenerationParams
from staticlm.runtime.speculate_options import SpeculateOptions, build_speculator


def run_generate_batch(*, prompt: str, run: RunOptions, params: GenerationParams, num_responses: int,
                       chat: bool = True, system_prompt: str | None = None, as_json: bool = False) -> dict:
    if not prompt.strip():
        raise ValueError("the prompt is empty: pass some text with --prompt")
    engine = open_engine(run)
    session = open_chat(engine, system_prompt=system_prompt)
    tokenizer = session.generator.tokenizer
    ids = (session.prompt_ids([Message(role="user", content=prompt)]) if chat
           else tokenizer.encode(prompt, add_special_tokens=True))
    speculator = build_speculator(SpeculateOptions.parse(run.speculate, fixed_length=run.draft_len), engine=engine,
                                  tokenizer=tokenizer, engine_options=engine.options, num_sequences=num_responses)
    batch = BatchGenerator(engine, tokenizer, num_responses=num_responses, speculator=speculator)
    batch.batch.warm_up()
    flag = StopFlag()
    t0 = time.perf_counter()
    with sigint_sets(flag):
        responses = batch.generate(ids, params, should_stop=flag)
    seconds = time.perf_counter() - t0
    num_tokens = sum(len(r.token_ids) for r in responses)
    summary = {
        "responses": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason.value,
                       "first_token_s": round(r.first_token_s, 4), "last_token_s": round(r.last_token_s, 4)}
                      for r in responses],
        "prompt_tokens": len(ids), "new_tokens": num_tokens, "total_tok_s": round(num_tokens / seconds, 2),
        "first_response_s": round(min(r.last_token_s for r in responses), 4),
        "mean_response_s": round(sum(r.last_token_s for r in responses) / len(responses), 4),
        "device": engine.device_name, "kv_copied_bytes": int(batch.batch.kv.stats.copied_bytes),
    }
    if speculator is not None:
        counters = batch.batch.counters
        summary.update(drafted_tokens=speculator.stats.num_drafted, accepted_tokens=speculator.stats.num_accepted,
                       verify_steps=speculator.stats.num_steps, decode_steps=counters.num_decode_steps,
                       acceptance_rate=round(speculator.stats.acceptance_rate, 3),
                       verify_rows=counters.num_verify_rows, verify_real_rows=counters.num_verify_tokens)
    if as_json:
        print(json.dumps(summary))
    else:
        for i, r in sorted(enumerate(responses), key=lambda ir: ir[1].last_token_s):
            sys.stdout.write(f"--- response {i + 1} ({r.last_token_s:.1f} s, {r.finish_reason.value}) ---\n{r.text}\n")
    if any(r.finish_reason is FinishReason.CANCELLED for r in responses):
        from .generate import Interrupted

        raise Interrupted("interrupted: generation stopped by Ctrl-C")
    return summary
