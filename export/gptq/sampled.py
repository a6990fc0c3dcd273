"""More calibration rows for GPTQ: the float model's own sampled answers to the calibration prompts, re-read in full
chunks (as export/calibration/traces.py re-reads the long conversation).

The recorded traces hold a few thousand rows, most of them the same prompts again: enough for activation ranges,
too few for a Hessian over K = 576 or 1536 inputs, where GPTQ then fits the calibration rows rather than text.
Sampled answers (seeded, so an export is reproducible) add rows the model itself would produce, varied and in its
own distribution, without shipping a corpus.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from staticlm.export.calibration.traces import TraceStep, calibration_prompts, window_rows
from staticlm.runtime.model import Model, chat_format
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device
from staticlm.runtime.text.chat_template import Message

TEMPERATURE = 0.8
SEED = 0


def sampled_replays(float_dir: Path, *, max_new_tokens: int, max_past_rows: int) -> list[TraceStep]:
    """Each calibration prompt answered by sampling up to max_new_tokens, then the whole sequence as full chunks
    after its first token (attention is causal: each row is exactly the step that wrote it), each chunk's past
    windowed to max_past_rows (the calibrating graph's window)."""
    fmt = chat_format(float_dir)
    engine = Model.open(float_dir, RunOptions(device=Device.CPU), warm_up=False).engine
    chunk, room = max(engine.prefill_len, 1), engine.max_context - 1
    rng = np.random.default_rng(SEED)
    steps: list[TraceStep] = []
    num_new = min(max_new_tokens, room // 2)  # a long prompt keeps its end (the assistant header)
    for prompt in calibration_prompts():
        tokens = fmt.prompt_ids([Message(role="user", content=prompt)])[-(room - num_new):]
        engine.reset()
        logits = engine.prefill(tokens)
        for _ in range(num_new):
            z = (logits - logits.max()) / TEMPERATURE
            p = np.exp(z.astype(np.float64))
            token = int(rng.choice(p.size, p=p / p.sum()))
            if token in fmt.tokenizer.eos_token_ids:
                break
            tokens.append(token)
            logits = engine.decode(token)
        block = engine.kv.valid_block(0)  # [T, n, D]
        steps += [TraceStep(window_rows(block[:, :p], max_past_rows).copy(), np.asarray(tokens[p:p + chunk], np.int64),
                            p) for p in range(1, len(tokens) - chunk + 1, chunk)]
    engine.reset()
    return steps
