"""`staticlm bench`: its options, the rows it reports, and the context every benchmark function receives."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from staticlm.errors import UserError
from staticlm.runtime.model import Model
from staticlm.runtime.options import RunOptions
from staticlm.runtime.session.device import Device

DEFAULT_CONTEXTS = (128, 512, 1024, 2048)
DEFAULT_PROMPT_LEN = 1000


class Peer(str, Enum):
    """Systems run side by side with ours, each in its own process (see worker.py)."""

    GENAI = "genai"  # onnxruntime-genai, int4 CPU model from its own builder
    LLAMACPP = "llamacpp"  # llama.cpp through llama-cpp-python, on the same GGUF
    OPTIMUM = "optimum"  # optimum's ORTModelForCausalLM (fp32, dynamic KV)
    TRANSFORMERS = "transformers"  # transformers + torch (fp32)


class BenchError(UserError, ValueError):
    """Bad bench input: printed as one line by the CLI (a ValueError, so cli.py's handler catches it)."""


@dataclass(frozen=True)
class BenchOptions:
    model_dir: Path | None  # None: the default float family
    threads: int = 2
    contexts: tuple[int, ...] | None = None  # None: the defaults that fit the model
    prompt_len: int | None = None  # None: 1000, or what fits the model
    peers: tuple[Peer, ...] = ()
    out_dir: Path | None = None  # None: ./bench-<timestamp>
    quick: bool = False  # a smoke run: few steps, one repeat, small microbenchmark
    long_gen: int | None = None  # tokens of the per-position latency run (None: up to the largest context)
    # A --cpu-attention windows family of the same model: the window strategies' rows when model_dir keeps its
    # KV in place (GroupQueryAttention graphs have no windows to manage)
    windows_model: Path | None = None
    only: tuple[str, ...] = ()  # the row sets to run (command.BENCHMARKS' names); (): all of them
    # Git revisions of staticlm run beside this one in the speed and memory rounds (baseline.py): a change's
    # before and after in one run
    baselines: tuple[str, ...] = ()

    @property
    def decode_steps(self) -> int:
        return 4 if self.quick else 64

    @property
    def repeats(self) -> int:
        return 1 if self.quick else 2


def parse_contexts(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BenchError(f"--contexts must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 2 for v in values):
        raise BenchError(f"--contexts must be integers >= 2, got {text!r}")
    return tuple(sorted(set(values)))


def parse_peers(text: str) -> tuple[Peer, ...]:
    text = text.strip().lower()
    if text == "none":
        return ()
    if text == "all":
        return tuple(Peer)
    peers = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        try:
            peers.append(Peer(name))
        except ValueError:
            choices = ", ".join(p.value for p in Peer)
            raise BenchError(f"unknown peer {name!r}: choose all, none or a list of {choices}") from None
    if not peers:
        raise BenchError("--peers is empty: choose all, none or a list of peers")
    return tuple(dict.fromkeys(peers))


@dataclass
class Row:
    """One measured quantity: ours, and the same quantity for each peer that ran."""

    key: str  # stable id, e.g. "decode@1024"
    label: str  # what the table shows
    unit: str
    ours: float
    higher_is_better: bool = True
    peers: dict[str, float] = field(default_factory=dict)
    note: str = ""  # e.g. the baseline a row is compared against when no peer measures it

    def ratio(self, peer: str) -> float | None:
        """Ours over the peer as a speed: > 1 means ours is better (for times and bytes: peer / ours)."""
        theirs = self.peers.get(peer)
        if not theirs or not self.ours:
            return None
        return self.ours / theirs if self.higher_is_better else theirs / self.ours

    def to_dict(self) -> dict:
        return {"key": self.key, "label": self.label, "unit": self.unit, "ours": self.ours,
                "higher_is_better": self.higher_is_better, "peers": dict(self.peers),
                "ratios": {p: self.ratio(p) for p in self.peers}, "note": self.note}


@dataclass
class BenchContext:
    """What every benchmark function gets: the resolved options, the workload, and places for figures."""

    options: BenchOptions
    model_dir: Path
    contexts: tuple[int, ...]
    prompt_len: int
    text_ids: list[int]  # a long real text (tokens), for prompts and cache fills, identical for every system
    max_context: int
    decode_steps: int  # timed steps per decode context (fewer than the options' for tiny contexts)
    figures: dict[str, dict] = field(default_factory=dict)  # plot name -> its data (JSON-able)
    extra: dict[str, object] = field(default_factory=dict)  # JSON-able facts (host rates, skipped peers, ...)
    log: Callable[[str], None] = print
    started: float = field(default_factory=time.perf_counter)

    def model(self, *, model_dir: Path | None = None, **run_options) -> Model:
        """The family (or model_dir) freshly opened on the CPU with the bench's thread count, warmed up."""
        return Model.open(model_dir or self.model_dir,
                          RunOptions(device=Device.CPU, num_threads=self.options.threads, **run_options))


# A benchmark is a small function of the context returning rows; command.BENCHMARKS lists them in order.
Benchmark = Callable[[BenchContext], list[Row]]

