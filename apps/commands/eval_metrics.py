"""Teacher-forced comparison of a family against a reference family: top-1 agreement and perplexity.

Both engines read the same token stream in windows that fit the smaller family's largest context
(each window starts from an empty cache), so positions and context are identical for both.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from staticlm.errors import InvalidOption
from staticlm.runtime.engine.engine import Engine


@dataclass(frozen=True)
class EvalResult:
    num_tokens: int  # predictions compared
    agreement: float  # fraction of positions where both argmaxes agree
    ppl_model: float
    ppl_reference: float

    @property
    def ppl_change(self) -> float:
        """Relative perplexity increase of the model over the reference (0.05 = +5 %)."""
        return self.ppl_model / self.ppl_reference - 1.0


def held_out_text(path: Path | None = None) -> str:
    """The shipped English text, or the user's file (a one-line error when it cannot be read)."""
    if path is None:
        return resources.files("staticlm.apps").joinpath("data/eval_en.txt").read_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidOption(f"cannot read the evaluation text {path}: {e.strerror or e}") from None


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, computed stably in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(targets)), targets]


def compare(model: Engine, reference: Engine, token_ids: list[int], *, max_tokens: int | None = None) -> EvalResult:
    ids = np.asarray(token_ids, np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens + 1]
    window = min(model.max_context, reference.max_context)
    agree, nll_m, nll_r, count = 0, 0.0, 0.0, 0
    for start in range(0, ids.size - 1, window - 1):  # windows overlap by one token: every target is scored once
        chunk = ids[start:start + window]
        if chunk.size < 2:
            break
        model.reset()
        reference.reset()
        lm, lr = model.score(chunk[:-1]), reference.score(chunk[:-1])
        targets = chunk[1:]
        agree += int((lm.argmax(axis=1) == lr.argmax(axis=1)).sum())
        nll_m += float(_nll(lm, targets).sum())
        nll_r += float(_nll(lr, targets).sum())
        count += targets.size
    if count == 0:
        raise InvalidOption("the evaluation text has fewer than two tokens")
    return EvalResult(num_tokens=count, agreement=agree / count, ppl_model=float(np.exp(nll_m / count)),
                      ppl_reference=float(np.exp(nll_r / count)))
