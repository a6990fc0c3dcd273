"""`staticlm eval`: how far a (quantized) family is from the float one, on a held-out text and chat answers."""
from __future__ import annotations

import json
from pathlib import Path

from staticlm.apps.models import ensure_default_model
from staticlm.errors import InvalidOption
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.model import Model
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device

from .eval_metrics import compare, held_out_text

ANSWER_PROMPTS = ("What is the capital of France?", "Give me two tips for sleeping better.",
                  "Write one sentence about the ocean.")
ANSWER_TOKENS = 48


def _greedy_answer(model: Model, prompt: str) -> str:
    model.generator.reset()  # each prompt from an empty cache, as the teacher-forced comparison left it
    return "".join(model.chat().send(prompt, GenerationParams(max_new_tokens=ANSWER_TOKENS))).strip()


def run_eval(*, model: Path, reference: Path | None, text: Path | None, max_tokens: int | None, num_answers: int,
             device: str, as_json: bool) -> int:
    options = RunOptions(device=device)
    reference = reference or ensure_default_model("float")
    quantized = Model.open(model, options, warm_up=False)
    ref = Model.open(reference, RunOptions(device=Device.CPU), warm_up=False)  # the float reference: CPU
    engine = quantized.engine
    if engine.manifest.model != ref.manifest.model:
        raise InvalidOption(f"{model} and {reference} are not the same model architecture")
    ids = quantized.tokenizer.encode(held_out_text(text), add_special_tokens=False)
    result = compare(engine, ref.engine, ids, max_tokens=max_tokens)
    answers = [(p, _greedy_answer(ref, p), _greedy_answer(quantized, p)) for p in ANSWER_PROMPTS[:num_answers]]
    summary = {"model": str(model), "quant": engine.manifest.precision, "kv_dtype": engine.manifest.kv_dtype,
               "tokens": result.num_tokens, "top1_agreement": result.agreement, "ppl": result.ppl_model,
               "ppl_reference": result.ppl_reference, "ppl_change": result.ppl_change,
               "answers": [{"prompt": p, "reference": a, "model": b} for p, a, b in answers]}
    if as_json:
        print(json.dumps(summary))
        return 0
    print(f"{model} ({summary['quant']}, KV {summary['kv_dtype']}) vs {reference}")
    print(f"  teacher-forced tokens : {result.num_tokens}")
    print(f"  top-1 agreement       : {100 * result.agreement:.2f} %")
    print(f"  perplexity            : {result.ppl_model:.3f} (reference {result.ppl_reference:.3f}, "
          f"{100 * result.ppl_change:+.2f} %)")
    for p, a, b in answers:
        print(f"\n  Q: {p}\n    reference: {a}\n    model    : {b}")
    return 0
