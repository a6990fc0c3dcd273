"""Next-token sampling over one row of logits, numpy only.

The order of the warpers follows transformers' defaults (temperature, top-k, top-p, min-p), so a
seeded run here and there filter the same candidate set.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Messages name the CLI option, because that is where a bad value almost always comes from.
        checks = (
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"--repetition-penalty must be > 0, got {self.repetition_penalty}"),
        )
        for ok, message in checks:
            if not ok:  # also catches NaN, for which every comparison is False
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def _penalize(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty (as transformers' RepetitionPenaltyLogitsProcessor): once per distinct token."""
    out = np.array(logits, dtype=np.float64)  # a copy: the caller's logits must stay untouched
    ids = np.unique(np.asarray(history, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


NUCLEUS_PROBES = (1024, 8192)  # top-p first looks among this many of the likeliest tokens, then this many
NUCLEUS_PROBE = NUCLEUS_PROBES[0]


def _nucleus_superset(probs: np.ndarray, *, top_p: float) -> np.ndarray:
    """A mask of the tokens at least as likely as the k-th likeliest, for the first k of NUCLEUS_PROBES whose
    mass reaches top_p (else all). The nucleus is a prefix of the sorted order, so it lies inside (ties at the
    boundary come along), and only those tokens need sorting: sorting SmolLM2's 49,152 took 3-7 ms a token.
    """
    for k in NUCLEUS_PROBES:
        if k >= probs.size:
            break
        likely = probs >= np.partition(probs, probs.size - k)[probs.size - k]
        if probs[likely].sum() >= top_p:
            return likely
    return np.ones(probs.size, bool)


def _filtered(logits: np.ndarray, params: SamplingParams,
              history: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | int:
    """The candidate ids and their probabilities after every warper, or the token when greedy."""
    logits = np.asarray(logits).reshape(-1)
    if params.repetition_penalty != 1.0 and len(history):
        scores = _penalize(logits, history, params.repetition_penalty)
    else:
        scores = logits.astype(np.float64)  # astype copies, so later in-place work is safe
    if params.is_greedy:
        return greedy(scores)
    scores /= params.temperature
    vocab = scores.shape[0]
    if 0 < params.top_k < vocab:
        # argpartition is O(V); only the k survivors are ever sorted.
        candidates = np.sort(np.argpartition(scores, vocab - params.top_k)[vocab - params.top_k:])
        values = scores[candidates]
    else:
        candidates, values = None, scores  # every token, in id order (materialised only if needed)
    top = values.max()
    if not np.isfinite(top):  # everything masked to -inf (or NaN): nothing to sample from
        return greedy(scores)
    probs = np.exp(values - top)  # stable softmax: the largest exponent is 0
    probs /= probs.sum()
    if params.top_p < 1.0 and values.size > NUCLEUS_PROBE:
        likely = _nucleus_superset(probs, top_p=params.top_p)
        candidates = np.flatnonzero(likely) if candidates is None else candidates[likely]
        values, probs = values[likely], probs[likely]
    if candidates is None:
        candidates = np.arange(vocab)
    if params.top_p < 1.0 or len(candidates) < vocab:
        order = np.argsort(-values, kind="stable")  # ties: lower token id first, as argmax
        candidates, values, probs = candidates[order], values[order], probs[order]
    keep = len(probs)
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p; always at least the most likely token.
        keep = min(int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1, keep)
    probs, candidates = probs[:keep], candidates[:keep]
    if params.min_p > 0.0:
        mask = probs >= params.min_p * probs.max()
        probs, candidates = probs[mask], candidates[mask]
    return candidates, probs


def sample(logits: np.ndarray, params: SamplingParams, *, rng: np.random.Generator,
           history: Sequence[int] = ()) -> int:
    """Pick the next token from logits [V]; pure apart from drawing from `rng`."""
    filtered = _filtered(logits, params, history)
    if isinstance(filtered, int):
        return filtered
    candidates, probs = filtered
    cdf = np.cumsum(probs)
    # Inverse-CDF draw: one uniform number per token keeps seeded runs reproducible.
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(candidates[min(index, len(candidates) - 1)])


def distribution(logits: np.ndarray, params: SamplingParams, *, history: Sequence[int] = ()) -> np.ndarray:
    """The distribution `sample` draws from, dense over the vocabulary [V] (one-hot when greedy).

    Speculative sampling needs the target's (and a draft model's) distribution itself, not a draw.
    """
    vocab = np.asarray(logits).size
    out = np.zeros(vocab, np.float64)
    filtered = _filtered(logits, params, history)
    if isinstance(filtered, int):
        out[filtered] = 1.0
    else:
        candidates, probs = filtered
        out[candidates] = probs / probs.sum()
    return out


__all__ = ["SamplingParams", "sample", "greedy", "distribution"]
