"""A thin wrapper over a `tokenizers` tokenizer.json with the special-token facts the runtime needs."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from staticlm.runtime.family.manifest import ManifestError


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 add_bos_token: bool = False) -> None:
        self._tok = tokenizer
        self._bos = None if bos_token_id is None else int(bos_token_id)
        self._eos = tuple(int(t) for t in eos_token_ids)
        self.add_bos_token = add_bos_token
        added = tokenizer.get_added_tokens_decoder()
        self._special = frozenset(int(i) for i, tok in added.items() if tok.special)
        # Some tokenizer.json files add BOS in their post-processor already; never add a second one.
        self._post_adds_bos = self._bos is not None and self._bos in tokenizer.encode("", add_special_tokens=True).ids

    @classmethod
    def from_file(cls, path: str | Path, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                  add_bos_token: bool = False) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise ManifestError(f"tokenizer file not found: {path}")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for unreadable JSON
            raise ManifestError(f"cannot read tokenizer {path}: {_one_line(e)}") from None
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids, add_bos_token=add_bos_token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it throughout): a server that tokenizes a long
        # prompt on a worker thread keeps answering its other requests meanwhile
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self._bos is not None and not self._post_adds_bos:
            ids = [self._bos, *ids]
        return list(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special


__all__ = ["Tokenizer"]
