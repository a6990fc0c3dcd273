"""The run options, declared once.

Each field of `RunOptions` carries its type, default, choices, range and help, declared as every option of
staticlm is (runtime/option_fields.py, which export/options.py's ExportRequest uses too). The CLI builds the flags
of every command that runs a model from these fields (apps/cli.py), the desktop app its settings and their saved
form (apps/gui/settings.py), and `Model.open` the engine, generator and chat from them (runtime/model.py).
A front end that differs in a default (a chat window samples, the CLI is greedy) says so here, in the field.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from staticlm.errors import InvalidOption
from staticlm.kv_manager import Overflow, Strategy
from staticlm.runtime.engine.engine_options import EngineOptions
from staticlm.runtime.family.generation_defaults import DEFAULTS as SAMPLING
from staticlm.runtime.family.generation_defaults import FIELDS as SAMPLING_FIELDS
from staticlm.runtime.family.generation_defaults import resolve
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.option_fields import SAME, coerce_fields, flag, option, spec
from staticlm.runtime.session.device import DEFAULT_SOC_MODEL, Device, DeviceOptions, parse_provider_options
from staticlm.runtime.speculative.speculate_options import SpeculateOptions

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
__all__ = ["RunOptions", "flag", "reload_fields", "run_option_fields", "spec"]


@dataclass(frozen=True)
class RunOptions:
    # -- the model and where it runs (changing one reopens the model) ----------------------------------
    model_dir: Path | None = option(None, "exported model directory (default: the embedded SmolLM2)",
                                    flag="--model", reloads=True)
    device: Device = option(Device.AUTO, "auto, cpu or htp (a Qualcomm NPU through QNN)", reloads=True)
    num_threads: int | None = option(None, "CPU threads (default: physical cores)", flag="--threads", low=1,
                                     reloads=True)
    soc_model: str = option(DEFAULT_SOC_MODEL, "QNN SoC model for htp (57: Snapdragon 8 Gen 3)", metavar="SOC",
                            reloads=True)
    qnn_options: tuple[str, ...] = option((), "htp: a QNN execution provider option KEY=VALUE for every session "
                                          "(repeatable), e.g. htp_share_resource_optimization=1 on a device",
                                          flag="--qnn-option", metavar="KEY=VALUE", reloads=True)
    kv_strategy: Strategy = option(Strategy.POINTER, "window graphs: pointer, shift, concat or bmc; in-place "
                                   "graphs (the cpu target's default) use in_place, their only strategy",
                                   reloads=True)
    kv_reserve: float = option(2.0, "KV buffer rows as a multiple of S-1", low=1.0, low_exclusive=True, high=8.0,
                               reloads=True)
    overflow: Overflow = option(Overflow.ERROR, "when the context is full: error, or slide out the oldest tokens",
                                flag="--on-overflow", reloads=True, app_default=Overflow.SLIDE)
    bmc_r: int | None = option(None, "window graphs: rows a BMC ladder rung grows by (default: from the host's "
                               "measured rates, see staticlm bench)", low=1, reloads=True)
    prepack: bool = option(False, "let batched, verify and prefill graphs keep repacked weights: faster, one "
                           "weight copy each", reloads=True)
    run_parts: bool = option(False, "run every graph as its chain of layer-group parts (a family exported with "
                             "--parts N)", flag="--parts", reloads=True)
    prefill_workers: int = option(1, "KV-Runahead: workers that prefill a long prompt in parallel, each on its "
                                  "share of --threads (an in-place family exported with --parts N)", low=1,
                                  reloads=True)
    shared_prompt_kv: bool = option(False, "--num-responses: every row reads one copy of the prompt's K/V through "
                                    "the family's segmented graphs (cpu families) instead of its own copy: about "
                                    "1/n of the KV memory, a cheaper step on long prompts, a dearer one on short "
                                    "ones", reloads=True)
    lone_rows: bool = option(False, "let a decode step run one row alone (cpu families without staticlm's "
                             "kernels, whose rows need no pairing): faster decode, but a greedy answer may then "
                             "change with the prompt cache, the batch or speculation",
                             reloads=True)
    speculate: str | None = option(None, "speculative decoding: none, lookup or draft:DIR (default: lookup, its "
                                   "drafts filling the rows, on a family whose token graph verifies several rows, "
                                   "the NPU plan's; none elsewhere)", metavar="{none,lookup,draft:DIR}", reloads=True)
    draft_len: int | None = option(None, "fixed draft length (default: BASS's dynamic one)", low=1, reloads=True)
    # -- each answer -----------------------------------------------------------------------------------
    max_new_tokens: int = option(256, "most tokens an answer may have", low=1, app_default=512)
    # Sampling: unset, the model's own default, else the shared table's (runtime/family/generation_defaults.py)
    temperature: float | None = option(None, f"0 = exact greedy (default: the model's own, else "
                                       f"{SAMPLING['temperature']})", low=0.0)
    top_k: int | None = option(None, f"keep the k likeliest tokens, 0: off (default: the model's own, else "
                               f"{SAMPLING['top_k']})", low=0)
    top_p: float | None = option(None, f"keep the smallest set of tokens whose mass reaches p (default: the model's "
                                 f"own, else {SAMPLING['top_p']})", low=0.0, low_exclusive=True, high=1.0)
    min_p: float | None = option(None, f"drop tokens below min_p x the likeliest token's probability (default: the "
                                 f"model's own, else {SAMPLING['min_p']})", low=0.0)
    repetition_penalty: float | None = option(None, f"divide the logits of tokens already seen, CTRL-style "
                                              f"(default: the model's own, else {SAMPLING['repetition_penalty']})",
                                              low=0.0, low_exclusive=True)
    seed: int | None = option(None, "seed of the sampler (default: a fresh one)")
    stop: tuple[str, ...] = option((), "stop string (repeatable)")
    ignore_eos: bool = option(False, "keep decoding to --max-new-tokens (benchmarks)")
    system_prompt: str | None = option(None, "system prompt", flag="--system", app_default=DEFAULT_SYSTEM_PROMPT)

    def __post_init__(self) -> None:
        coerce_fields(self)
        parse_provider_options(self.qnn_options)
        SpeculateOptions.parse(self.speculate, fixed_length=self.draft_len)

    # -- what the runtime is built from ----------------------------------------------------------------
    def engine_options(self) -> EngineOptions:
        return EngineOptions(device=DeviceOptions(device=self.device, num_threads=self.num_threads,
                                                  soc_model=self.soc_model,
                                                  provider_options=parse_provider_options(self.qnn_options)),
                             kv_strategy=self.kv_strategy, kv_reserve=self.kv_reserve, overflow=self.overflow,
                             bmc_r=self.bmc_r, prepack=self.prepack, run_parts=self.run_parts,
                             prefill_workers=self.prefill_workers, paired_rows=not self.lone_rows)

    def speculate_options(self) -> SpeculateOptions:
        return SpeculateOptions.parse(self.speculate, fixed_length=self.draft_len)

    def generation_params(self, model_defaults: Mapping[str, float] | None = None) -> GenerationParams:
        """The answer's parameters; model_defaults: the family's own sampling defaults (Manifest.generation_defaults),
        which fill the sampling fields left unset before the shared table does (generation_defaults.resolve)."""
        sampling = resolve({name: getattr(self, name) for name in SAMPLING_FIELDS}, model_defaults)
        return GenerationParams(max_new_tokens=self.max_new_tokens, stop_strings=self.stop,
                                ignore_eos=self.ignore_eos, sampling=SamplingParams(**sampling, seed=self.seed))

    @property
    def system_prompt_or_none(self) -> str | None:
        return (self.system_prompt or "").strip() or None

    def needs_reload(self, other: RunOptions) -> bool:
        """Whether going from self to other changes an option the engine is built from."""
        return any(getattr(self, f.name) != getattr(other, f.name) for f in reload_fields())

    def replace(self, **changes: Any) -> RunOptions:
        return dataclasses.replace(self, **changes)

    # -- the desktop app's defaults and saved form ------------------------------------------------------
    @classmethod
    def app_defaults(cls) -> RunOptions:
        return cls(**{f.name: spec(f).app_default for f in dataclasses.fields(cls)
                      if spec(f).app_default is not SAME})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: enums by value, paths as text."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: RunOptions | None = None) -> RunOptions:
        """base (default: the app's defaults) with the values of data on top; unknown keys are ignored, and a
        value that is ill-typed or out of range keeps base's, one field at a time."""
        if not isinstance(data, dict):
            raise InvalidOption("run options must be a JSON object")
        options = base or cls.app_defaults()
        for f in dataclasses.fields(cls):
            if f.name in data:
                try:
                    options = dataclasses.replace(options, **{f.name: data[f.name]})
                except (InvalidOption, TypeError, ValueError):
                    continue
        return options


def run_option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(RunOptions)


def reload_fields() -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in run_option_fields() if spec(f).reloads)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
