"""Incremental detokenization: text appears as soon as it is final, at O(1) cost per token.

Same scheme as HF TGI and vLLM. Only the window ids[prefix:] is decoded, and the text of
ids[prefix:read] (already shown) is subtracted from it. Decoding from `prefix` rather than `read`
gives the decoder one token of left context. That context is what makes SentencePiece's
leading-space rule and byte-level BPE's byte joining come out as in a full decode.

tokenizers' own DecodeStream runs the same scheme but does not fit here: it has no flush (the bytes of a
character that never completes are lost when the response ends), and where a later token changes text already
shown (a byte-fallback run that turns out invalid UTF-8) it raises instead of going on
(tests/test_text.py: test_stream_decoder_flushes_an_unfinished_character, test_stream_decoder_takes_any_ids).
"""
from __future__ import annotations

from staticlm.runtime.text.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a lossy UTF-8 decode shows for a character whose bytes are still coming


class StreamDecoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._skip = tokenizer.special_ids
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of what has been shown

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a character or a word is still incomplete)."""
        token_id = int(token_id)
        if token_id in self._skip:  # specials are never shown, and must not split the byte stream
            return ""
        self._ids.append(token_id)
        shown = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) > len(shown) and not text.endswith(_INCOMPLETE):
            # Slide the window: the shown part is final, so it no longer needs re-decoding.
            # Ids before the window are never decoded again: dropping them bounds memory too.
            del self._ids[:self._read]
            self._prefix, self._read = 0, len(self._ids)
            return text[len(shown):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (e.g. bytes of a character that never completed)."""
        shown = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self.reset()
        return text[len(shown):]

    def reset(self) -> None:
        self._ids.clear()
        self._prefix = self._read = 0

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self.tokenizer.decode(self._ids[start:stop], skip_special_tokens=True)


__all__ = ["StreamDecoder"]
