"""Sampling defaults, declared once for every front end (generate, chat, the app, serve, the Python API).

A field the user leaves unset takes the model's own value where its source carries one (an HF checkpoint's
generation_config.json, a GGUF's general.sampling.* keys: the manifest's `generation_defaults`), else DEFAULTS'.
DEFAULTS sample, as llama-cli and Ollama do by default: greedy decoding of a small model loops on open questions
(the default SmolLM2 answered "What is the capital of France?" with one phrase repeated to the token limit). A
temperature of 0, given or the model's, is exact greedy: the fields left unset then change nothing (OFF). min_p
(llama.cpp's default too) drops the unlikely tail that lets a small model's sampled answer start repeating itself
(tests/test_greedy_serve.py asks the default model the README's question).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
DEFAULTS: dict[str, float] = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
OFF: dict[str, float] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# a model's value is kept only inside these bounds (else the field takes DEFAULTS'): (low, high, low inclusive)
_BOUNDS = {"temperature": (0.0, 2.0, True), "top_k": (0, 1 << 20, True), "top_p": (0.0, 1.0, False),
           "min_p": (0.0, 0.999, True), "repetition_penalty": (0.0, 10.0, False)}


def resolve(given: Mapping[str, float | None], model: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each field: given (not None), else the model's, else DEFAULTS'; with a temperature of 0, an unset field is
    OFF's."""
    model = model or {}
    temperature = next(v for v in (given.get("temperature"), model.get("temperature"), DEFAULTS["temperature"])
                       if v is not None)
    base = OFF if temperature == 0 else {**DEFAULTS, **model}
    out = {name: given[name] if given.get(name) is not None else base[name] for name in FIELDS}
    out["temperature"] = temperature
    out["top_k"] = int(out["top_k"])
    return out


def checked(values: Mapping[str, Any]) -> dict[str, float]:
    """A source's defaults: the known fields whose values are numbers within bounds (the rest left to DEFAULTS)."""
    out = {}
    for name, value in values.items():
        if name not in _BOUNDS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        low, high, inclusive = _BOUNDS[name]
        if (low <= value if inclusive else low < value) and value <= high:
            out[name] = int(value) if name == "top_k" else float(value)
    return out
