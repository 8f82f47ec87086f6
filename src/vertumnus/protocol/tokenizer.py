"""Text <-> token ids for the API's prompts and answers, and the chat template.

A Hugging Face folder with a ``tokenizer.json`` uses it, through the ``tokenizers``
package, with its chat template (``chat.py``). A preset (``tiny``, random
weights) gets a byte-level tokenizer: the UTF-8 bytes of the text are the token ids,
and the built-in ChatML template. Without either, text prompts are refused with a
message that says to send token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vertumnus.protocol.chat import ChatTemplate


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(
        self,
        name: str,
        impl: Any = None,
        byte_level: bool = False,
        chat: ChatTemplate | None = None,
    ) -> None:
        self.name, self._impl, self._bytes, self.chat = name, impl, byte_level, chat

    @classmethod
    def for_model(cls, model_dir: str | None, vocab_size: int) -> Tokenizer:
        if model_dir is None:
            if vocab_size < 256:
                return cls("none")
            return cls("byte-level", byte_level=True, chat=ChatTemplate.for_folder(None))
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            try:
                from tokenizers import Tokenizer as HfTokenizer
            except ImportError:
                return cls("none (install `tokenizers` to read tokenizer.json)")
            chat = ChatTemplate.for_folder(model_dir)
            return cls(str(path), HfTokenizer.from_file(str(path)), chat=chat)
        return cls("none")

    @property
    def has_text(self) -> bool:
        return self._bytes or self._impl is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: as the tokenizer's post-processor adds them (a
        BOS, for example); chat prompts are encoded without (their template wrote
        them)."""
        if self._bytes:
            return list(text.encode("utf-8"))
        if self._impl is not None:
            return list(self._impl.encode(text, add_special_tokens=add_special_tokens).ids)
        raise TokenizerError(
            f"this model has no tokenizer ({self.name}): send token ids instead of text"
        )

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._bytes:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if self._impl is not None:
            return str(self._impl.decode(ids, skip_special_tokens=skip_special_tokens))
        return ""

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs name it (special tokens included)."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary as the tokenizer spells it (a byte-level
        BPE's ``Ġworld``), as ``transformers``' ``convert_ids_to_tokens``; the
        byte-level tokenizer spells each byte's text."""
        if self._impl is not None:
            return [self._impl.id_to_token(i) or "" for i in ids]
        return [self.token_text(i) for i in ids]
