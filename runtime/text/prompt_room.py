"""How much of the context a prompt that does not fit may keep: the one rule every front end cuts prompts by."""
from __future__ import annotations


def max_prompt_tokens(*, max_context: int, max_new_tokens: int) -> int:
    """The tokens a prompt longer than the context is cut to (its end kept, or its chat template's head).

    The answer needs room after the prompt: max_new_tokens of it, but never more than a quarter of the context, so
    an answer limit near the context's size (the default of a long-context model, or a client's max_tokens) does
    not cut the prompt down to nothing: at least three quarters of the context stay for it.
    """
    return max_context - min(max_new_tokens, max_context // 4)
