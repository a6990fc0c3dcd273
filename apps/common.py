"""What every front end needs: where models live, and how to open one."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from staticlm.kv_manager import Overflow, Strategy
from staticlm.runtime.chat import ChatSession, TemplateInfo
from staticlm.runtime.device import DeviceOptions, parse_device
from staticlm.runtime.engine import Engine, EngineOptions
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.generator import Generator
from staticlm.runtime.speculate_options import SpeculateOptions, build_speculator
from staticlm.runtime.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


def home() -> Path:
    env = os.environ.get("STATICLM_HOME")
    if env:
        return Path(env)
    from platformdirs import user_data_dir

    return Path(user_data_dir("staticlm"))


def default_model_dir() -> Path:
    return home() / "models" / DEFAULT_MODEL


@dataclass(frozen=True)
class RunOptions:
    model_dir: Path | None
    device: str = "auto"
    num_threads: int | None = None
    soc_model: str | None = None
    kv_strategy: str = "pointer"
    kv_reserve: float = 2.0
    overflow: str = "error"
    speculate: str = "none"  # none, lookup or draft:DIR
    draft_len: int | None = None  # fixed draft length; None for BASS's dynamic one
    prepack: bool = False  # multi-row graphs keep their own repacked weights: speed for memory


def ensure_default_model(*, quiet: bool = False) -> Path:
    """Export the embedded default model once, the first time anything needs it."""
    target = default_model_dir()
    if (target / "manifest.json").is_file():
        return target
    from staticlm.apps.commands.export import run_export

    if not quiet:
        print(f"First run: exporting the default model ({DEFAULT_MODEL}) to {target}")
    run_export(model=DEFAULT_MODEL, out_dir=target, contexts=None, prefill_len=None, quiet=quiet)
    return target


def _enum(kind, value: str, what: str):
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(k.value for k in kind)
        raise UserError(f"unknown {what} {value!r}: choose one of {choices}") from None


def open_engine(opts: RunOptions) -> Engine:
    # Every option is checked before the (possibly minutes-long) first-run export.
    device = DeviceOptions(device=parse_device(opts.device), num_threads=opts.num_threads,
                           **({"soc_model": opts.soc_model} if opts.soc_model else {}))
    if not 1.0 < opts.kv_reserve <= 8.0:
        raise UserError(f"--kv-reserve must be in (1, 8], got {opts.kv_reserve}")
    SpeculateOptions.parse(opts.speculate, fixed_length=opts.draft_len)
    if opts.draft_len is not None and opts.draft_len < 1:
        raise UserError(f"--draft-len must be >= 1, got {opts.draft_len}")
    if opts.num_threads is not None and opts.num_threads < 1:
        raise UserError(f"--threads must be >= 1, got {opts.num_threads}")
    options = EngineOptions(device=device, kv_strategy=_enum(Strategy, opts.kv_strategy, "KV strategy"),
                            kv_reserve=opts.kv_reserve, overflow=_enum(Overflow, opts.overflow, "overflow policy"),
                            prepack=opts.prepack)
    engine = Engine(opts.model_dir or ensure_default_model(), options=options)
    engine.warm_up()
    return engine


def open_chat(engine: Engine, *, system_prompt: str | None = None, run: RunOptions | None = None) -> ChatSession:
    """A chat over the engine; `run` adds its speculative decoding choice."""
    m = engine.manifest
    tokenizer = open_tokenizer(engine.model_dir)
    template = TemplateInfo(chat_template=m.chat_template, bos_token=m.special_tokens.bos_token,
                            eos_token=m.special_tokens.eos_token)
    generator = Generator(engine, tokenizer)
    if run is not None:
        generator.speculator = build_speculator(SpeculateOptions.parse(run.speculate, fixed_length=run.draft_len),
                                                engine=engine, tokenizer=tokenizer, engine_options=engine.options)
    return ChatSession(generator, template, system_prompt=system_prompt)


def open_tokenizer(model_dir: Path) -> Tokenizer:
    m = load_manifest(model_dir)
    st = m.special_tokens
    return Tokenizer.from_file(Path(model_dir) / m.tokenizer_file, bos_token_id=st.bos_token_id,
                               eos_token_ids=st.eos_token_ids, add_bos_token=st.add_bos_token)
