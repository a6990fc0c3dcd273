"""Next-token sampling over one row of logits, numpy only.

The order of the warpers follows transformers' defaults (temperature, top-k, top-p, min-p), so a
seeded run here and there filter the same candidate set.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from staticlm.errors import InvalidOption


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # OpenAI's: logit -= frequency * count + presence * (count > 0), counted over the tokens generated so far
    # (history[num_prompt_tokens:]); logit_bias: (token id, bias) pairs added before any warper
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        # Messages name the CLI option, because that is where a bad value almost always comes from.
        checks = (
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"--repetition-penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
        )
        for ok, message in checks:
            if not ok:  # also catches NaN, for which every comparison is False
                raise InvalidOption(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def adjusted_logits(logits: np.ndarray, *, generated: Sequence[int], presence: float = 0.0, frequency: float = 0.0,
                    bias: Sequence[tuple[int, float]] = ()) -> np.ndarray:
    """OpenAI's penalties and logit_bias over logits [V], as a float64 copy: a token generated c times loses
    frequency * c + presence (when c > 0), a biased token gains its bias. Ids outside the vocabulary are ignored."""
    out = np.array(logits, dtype=np.float64).reshape(-1)  # [V], a copy: the caller's logits stay untouched
    vocab = out.shape[0]
    if presence or frequency:
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        keep = (ids >= 0) & (ids < vocab)
        out[ids[keep]] -= frequency * counts[keep] + presence
    for token, value in bias:
        if 0 <= token < vocab:
            out[token] += value
    return out


def _penalize(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty (as transformers' RepetitionPenaltyLogitsProcessor): once per distinct token."""
    out = np.array(logits, dtype=np.float64)  # a copy: the caller's logits must stay untouched
    ids = np.unique(np.asarray(history, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


# top-p looks among this many of the likeliest tokens, then twice as many, ...: a probe that falls short costs one
# partition of the tokens below it, sorting what a larger probe holds costs more
NUCLEUS_PROBES = (1024, 2048, 4096, 8192, 16384)
NUCLEUS_PROBE = NUCLEUS_PROBES[0]


def _nucleus_superset(raw: np.ndarray, *, temperature: float, top: float,
                      top_p: float) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Of the candidates' (penalised) logits `raw`: (mask, exp(raw[mask] / T - top), Z) for the tokens at least
    as likely as the k-th likeliest, for the first k of NUCLEUS_PROBES whose mass reaches top_p (None if none
    does); Z = sum(exp(raw / T - top)) over all of them.

    The nucleus is a prefix of the sorted order, so it lies inside the mask (ties at the boundary come along),
    and only those tokens need sorting: partitioning is O(V) a token, sorting the whole vocabulary O(V log V).
    The rank test and the mass outside the mask run in float32 (SIMD partition and exp over half the bytes
    float64 would take over the whole vocabulary); float32 rounding keeps the order, so the mask stays a
    prefix. The probabilities inside come from float64; the float32 tail only enters the top_p test, at a
    relative 1e-7 of its mass.
    """
    r32 = raw.astype(np.float32, copy=False)
    exp32 = np.exp((r32 - r32.max()) * np.float32(1.0 / temperature))
    lower, num_above = r32, 0  # the values below the last probe's boundary (unordered), how many lie above it
    for k in NUCLEUS_PROBES:
        if k >= raw.size:
            break
        cut = lower.size - (k - num_above)  # in lower, ascending: the k-th likeliest of all
        lower = np.partition(lower, cut)
        likely = r32 >= lower[cut]
        lower, num_above = lower[:cut], k
        head = np.exp(raw[likely].astype(np.float64) / temperature - top)
        mass = float(head.sum())
        z = mass + float(exp32[~likely].sum(dtype=np.float64))
        if mass >= top_p * z:
            return likely, head, z
    return None


def _filtered(logits: np.ndarray, params: SamplingParams,
              history: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | int:
    """The candidate ids and their probabilities after every warper, or the token when greedy."""
    logits = np.asarray(logits).reshape(-1)
    if params.adjusts_logits:
        logits = adjusted_logits(logits, generated=history[params.num_prompt_tokens:], bias=params.logit_bias,
                                 presence=params.presence_penalty, frequency=params.frequency_penalty)
    if params.repetition_penalty != 1.0 and len(history):
        scores = _penalize(logits, history, params.repetition_penalty)  # float64, a copy
    else:
        scores = logits  # never written to: the caller's logits stay untouched
    if params.is_greedy:
        return greedy(scores)
    vocab = scores.shape[0]
    if 0 < params.top_k < vocab:
        # argpartition is O(V); only the k survivors are ever sorted.
        candidates = np.sort(np.argpartition(scores, vocab - params.top_k)[vocab - params.top_k:])
        raw = scores[candidates]
    else:
        candidates, raw = None, scores  # every token, in id order (materialised only if needed)
    top_raw = raw.max()
    if not np.isfinite(top_raw):  # everything masked to -inf (or NaN): nothing to sample from
        return greedy(scores)
    top = float(np.float64(top_raw) / params.temperature)  # the largest of raw / T, as float64
    nucleus = (_nucleus_superset(raw, temperature=params.temperature, top=top, top_p=params.top_p)
               if params.top_p < 1.0 and raw.size > NUCLEUS_PROBE else None)
    if nucleus is None:
        values = raw.astype(np.float64) / params.temperature
        probs = np.exp(values - top)  # stable softmax: the largest exponent is 0
        probs /= probs.sum()
    else:
        likely, head, z = nucleus
        candidates = np.flatnonzero(likely) if candidates is None else candidates[likely]
        values, probs = raw[likely].astype(np.float64) / params.temperature, head / z
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


__all__ = ["SamplingParams", "adjusted_logits", "distribution", "greedy", "sample"]
