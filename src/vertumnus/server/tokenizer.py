"""Text <-> token ids for the API's ``prompt`` fields.

A Hugging Face folder with a ``tokenizer.json`` uses it, through the ``tokenizers``
package when it is installed. A preset (``tiny``, random weights) gets a byte-level
tokenizer: the UTF-8 bytes of the text are the token ids. Without either, text
prompts are refused with a message that says to send ``token_ids``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, name: str, impl: Any = None, byte_level: bool = False) -> None:
        self.name, self._impl, self._bytes = name, impl, byte_level

    @classmethod
    def for_model(cls, model_dir: str | None, vocab_size: int) -> Tokenizer:
        if model_dir is None:
            if vocab_size < 256:
                return cls("none")
            return cls("byte-level", byte_level=True)
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            try:
                from tokenizers import Tokenizer as HfTokenizer
            except ImportError:
                return cls("none (install `tokenizers` to read tokenizer.json)")
            return cls(str(path), HfTokenizer.from_file(str(path)))
        return cls("none")

    def encode(self, text: str) -> list[int]:
        if self._bytes:
            return list(text.encode("utf-8"))
        if self._impl is not None:
            return list(self._impl.encode(text).ids)
        raise TokenizerError(
            f"this model has no tokenizer ({self.name}): send 'token_ids' instead of text"
        )

    def decode(self, ids: list[int]) -> str:
        if self._bytes:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if self._impl is not None:
            return str(self._impl.decode(ids))
        return ""
