"""Calibration for a target that records no traces of its own (the CPU): the float family in the HTP layout, run
on the CPU EP over the shipped calibration prompts exactly as `export --target htp` runs it (calibration/traces.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from staticlm.export.calibration.traces import calibration_prompts, record_traces, template_entry
from staticlm.export.family import ExportOptions, export_family
from staticlm.export.sources.model import LoadedModel
from staticlm.runtime.model import chat_format
from staticlm.runtime.text.chat_template import Message

from .calibrated import round_on_traces
from .options import GptqOptions

CALIB_NEW_TOKENS = 24  # greedy tokens per prompt, as htp/family.py records them
MASK_VALUE = -100.0  # the float family's masked level (htp/options.py's default)


def calibrated_rounding(model: LoadedModel, work: Path, *, options: ExportOptions, gptq: GptqOptions,
                        calib_steps: int, step: Callable[[str], None]) -> tuple[LoadedModel, dict]:
    """The model with its float projections GPTQ-rounded (calibrated.py) on traces recorded in work (scratch)."""
    calib = dataclasses.replace(options, htp_style=True, batch_sizes=(), verify_lens=())
    float_dir = work / "calibration"
    fm = export_family(model, float_dir, options=calib)
    step("calibration family")
    fmt = chat_format(float_dir)
    prompts = calibration_prompts()
    ids = [fmt.prompt_ids([Message(role="user", content=p)]) for p in prompts]
    first = tuple(sorted({fmt.tokenizer.encode(p, add_special_tokens=False)[0] for p in prompts if p}))
    traces = record_traces(float_dir, ids, max_steps=calib_steps, max_new_tokens=CALIB_NEW_TOKENS,
                           eos_ids=fmt.tokenizer.eos_token_ids, sink_ids=first, on_prompt=lambda: None,
                           max_past_rows=template_entry(fm.graphs).shape.past_len)
    step("calibration traces")
    return round_on_traces(model, float_dir, fm, traces.family_steps + traces.replay_steps, mask_value=MASK_VALUE,
                           options=gptq, step=step)
