"""A reasoning model's thoughts: `<think>…</think>` split from the answer (whole, or as it streams), thinking
turned off the ways chat templates define (`enable_thinking`, `/no_think`), and a budget of reasoning tokens
after which `</think>` is forced (llama-server's --reasoning-budget).

Whether a model reasons is read from its chat template (it writes `<think>`); whether an answer starts inside
the thoughts, from the prompt (templates such as DeepSeek-R1's and Qwen3-Thinking's end it with `<think>`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

OPEN, CLOSE = "<think>", "</think>"
NO_THINK, THINK = "/no_think", "/think"


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's answers are read: split (else the thoughts stay in content), and whether the answer
    starts inside them (the prompt opened <think>)."""

    split: bool
    started: bool


def template_reasons(template: Any) -> bool:
    templates = [template] if isinstance(template, str) else list((template or {}).values())
    return any(CLOSE in t for t in templates)


def soft_switch(last_user_text: str) -> bool | None:
    """Qwen3's soft switch: a user turn ending in /no_think turns thinking off, /think on (None: neither)."""
    tail = last_user_text.rstrip()
    if tail.endswith(NO_THINK):
        return False
    if tail.endswith(THINK):
        return True
    return None


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """The prompt ends inside an open <think> (the answer starts with thoughts, no tag of its own)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN) or (tail.rfind(OPEN) > tail.rfind(CLOSE) and OPEN in tail)


def split_reasoning(text: str, *, started: bool) -> tuple[str | None, str]:
    """(the thoughts, or None; the answer) of a whole answer. An unclosed block is all thoughts."""
    body = text
    if not started:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        body = stripped[len(OPEN):]
    thoughts, closed, answer = body.partition(CLOSE)
    return thoughts.strip(), answer.lstrip() if closed else ""


class ReasoningStream:
    """split_reasoning as the text arrives: push(delta) gives (thoughts, answer) deltas; a tag split across
    deltas is held back until it is whole."""

    def __init__(self, *, started: bool) -> None:
        self._state = "thinking" if started else "start"
        self._held = ""
        self._lead = started  # strip the whitespace right after a tag (an answer without one is kept whole)

    def push(self, text: str) -> tuple[str, str]:
        thoughts, answer = [], []
        held, self._held = self._held + text, ""
        while held:
            if self._state == "start":
                stripped = held.lstrip()
                if OPEN.startswith(stripped) and stripped != OPEN:  # "", "<", "<th", ...: not yet known
                    self._held = held
                    break
                if stripped.startswith(OPEN):
                    self._state, held, self._lead = "thinking", stripped[len(OPEN):], True
                    continue
                self._state, self._lead = "answer", False
            if self._state == "answer":
                answer.append(self._lstrip(held))
                break
            cut = held.find(CLOSE)
            if cut >= 0:
                thoughts.append(self._lstrip(held[:cut]))
                self._state, held, self._lead = "answer", held[cut + len(CLOSE):], True
                continue
            keep = _partial_suffix(held, CLOSE)
            thoughts.append(self._lstrip(held[:len(held) - keep]))
            self._held = held[len(held) - keep:]
            break
        return "".join(thoughts), "".join(answer)

    def _lstrip(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "thinking":
            return self._lstrip(held), ""
        return "", self._lstrip(held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class BudgetConstraints:
    """A factory of ThinkingBudget constraints (one per choice): at most `budget` reasoning tokens, then the
    close tag's ids are forced; after it, `inner` (a grammar's factory, or None) constrains the answer."""

    def __init__(self, *, budget: int | None, close_ids: list[int], tokenizer, started: bool, inner=None) -> None:
        self.budget, self.close_ids, self.tokenizer, self.inner = budget, close_ids, tokenizer, inner
        self.started = started  # else the answer may open <think> itself (no inner grammar then: it would
        # miss those first tokens)

    def __call__(self) -> ThinkingBudget:
        return ThinkingBudget(self, self.inner() if self.inner else None)


class ThinkingBudget:
    """runtime.sequence_request.Constraint over an answer's thoughts (then its inner constraint, if any)."""

    def __init__(self, spec: BudgetConstraints, inner) -> None:
        self.spec, self.inner = spec, inner
        self.num_thought = 0  # reasoning tokens so far
        self.num_forced = 0  # close tag ids forced so far
        self.tail = ""  # the last characters seen (to see the model open or close its thoughts itself)
        self.opening = not spec.started  # the answer has not shown yet whether it opens <think>
        self.thinking = spec.started

    def allowed(self, vocab_size: int) -> np.ndarray | None:
        if self.opening:
            return None
        if not self.thinking:
            return self.inner.allowed(vocab_size) if self.inner else None
        if self.spec.budget is None or self.num_thought < self.spec.budget:
            return None
        mask = np.zeros(vocab_size, bool)  # [V] only the close tag's next id
        mask[self.spec.close_ids[self.num_forced]] = True
        return mask

    def consume(self, token_id: int) -> None:
        if self.opening:
            self.tail += self.spec.tokenizer.decode([token_id])
            head = self.tail.lstrip()
            if head.startswith(OPEN):
                self.opening, self.thinking, self.tail = False, True, head[len(OPEN):]
            elif not OPEN.startswith(head):
                self.opening = False  # an answer without thoughts
            return
        if not self.thinking:
            if self.inner:
                self.inner.consume(token_id)
            return
        if self.spec.budget is not None and self.num_thought >= self.spec.budget:
            self.num_forced += 1
            self.thinking = self.num_forced < len(self.spec.close_ids)
            return
        self.num_thought += 1
        self.tail = (self.tail + self.spec.tokenizer.decode([token_id]))[-4 * len(CLOSE):]
        if CLOSE in self.tail:
            self.thinking = False


__all__ = ["BudgetConstraints", "ReasoningPlan", "ReasoningStream", "ThinkingBudget", "prompt_opens_thinking",
           "soft_switch", "split_reasoning", "template_reasons"]
