"""The prompt-room rule (runtime/text/prompt_room.py): what a prompt longer than the context is cut to."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staticlm.runtime.text.prompt_room import max_prompt_tokens


@pytest.mark.parametrize(("max_context", "max_new_tokens", "expected"), [
    (2048, 0, 2048),  # no answer asked for: the whole context
    (2048, 256, 1792),  # a short answer: exactly its room is kept free
    (2048, 512, 1536),  # an answer of a quarter of the context: still its room
    (2048, 513, 1536),  # past a quarter: the prompt keeps three quarters
    (2048, 10**6, 1536),
    (10, 100, 8),  # a quarter rounds down: 2 rows of 10
    (3, 100, 3),  # a context under 4 rows reserves nothing (the answer slides)
    (1, 1, 1),
])
def test_the_answer_gets_its_room_but_at_most_a_quarter_of_the_context(max_context, max_new_tokens, expected):
    assert max_prompt_tokens(max_context=max_context, max_new_tokens=max_new_tokens) == expected


@given(max_context=st.integers(1, 1 << 20), max_new_tokens=st.integers(0, 1 << 22))
def test_a_prompt_keeps_at_least_three_quarters_and_never_more_than_the_context(max_context, max_new_tokens):
    room = max_prompt_tokens(max_context=max_context, max_new_tokens=max_new_tokens)
    assert 3 * max_context <= 4 * room <= 4 * max_context
    if 4 * max_new_tokens <= max_context:  # an answer that fits in a quarter gets all of its room, no more
        assert room + max_new_tokens == max_context
