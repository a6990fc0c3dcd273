"""The context ladder's step r for graphs with a symbolic past length (the `--target cpu` family).

A static graph attends over its whole past window P, valid or not; the ladder runs the smallest window
that holds the valid rows, growing in steps of r. BMC's model picks r = N / T with
T = sqrt(N * C') (C' = aBW / (2 bC), both measured on this host by `staticlm bench` and cached here);
without a measurement the paper's C' = 0.1 stands in. `--bmc-r` overrides both.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from staticlm.errors import InvalidOption
from staticlm.kv_manager.sizing import choose_bmc_r

PAPER_C_PRIME = 0.1
CACHE_NAME = "bmc_host.json"


@dataclass(frozen=True)
class HostRates:
    """What the BMC microbenchmark measured on this host."""

    copy_bandwidth: float  # aBW, bytes of KV rows copied per second
    attention_rate: float  # bC, attention multiply-accumulates per second (decode, one row per token)
    c_prime: float  # C' in the paper's units: aBW / (2 bC) with its 4-byte-per-row-element convention
    c0_seconds: float = 0.0  # a one-off cost per rung change (allocation, or a new shape for ORT)

    def to_dict(self) -> dict:
        return {"copy_bandwidth": self.copy_bandwidth, "attention_rate": self.attention_rate,
                "c_prime": self.c_prime, "c0_seconds": self.c0_seconds}


def cache_path() -> Path:
    env = os.environ.get("STATICLM_CACHE")
    if env:
        return Path(env) / CACHE_NAME
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("staticlm")) / CACHE_NAME


def load_rates(path: Path | None = None) -> HostRates | None:
    try:
        d = json.loads((path or cache_path()).read_text())
        return HostRates(float(d["copy_bandwidth"]), float(d["attention_rate"]), float(d["c_prime"]),
                         float(d.get("c0_seconds", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no (or an unreadable) measurement: the paper's constant stands in


def save_rates(rates: HostRates, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates.to_dict(), indent=1))
    return path


def ladder_step(*, max_context: int, override: int | None = None, rates: HostRates | None = None) -> int:
    """r: rows the window grows by per rung."""
    if override is not None:
        if override < 1:
            raise InvalidOption(f"--bmc-r must be >= 1, got {override}")
        return override
    rates = rates or load_rates()
    return choose_bmc_r(max_context=max_context, c_prime=rates.c_prime if rates else PAPER_C_PRIME)


def rung_past_len(num_valid: int, *, step: int, max_past: int) -> int:
    """The smallest multiple of `step` that holds num_valid rows (at least one step), capped at max_past."""
    return min(max(step, -(-num_valid // step) * step), max_past)
