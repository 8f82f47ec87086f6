"""What the REST app keeps (aiohttp ``AppKey``s): the coordinator, the tokenizer, the
model's end-of-sequence ids, the address the server listens on once bound, and the
decode proxy when there is one."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from vertumnus.protocol.request import GenerateRequest
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator

COORDINATOR = web.AppKey("coordinator", Coordinator)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
# The served model's end-of-sequence ids (``config.model.eos_token_ids`` of its
# folder; none for a preset): they end the one token the pool answers by itself.
EOS_TOKEN_IDS = web.AppKey("eos_token_ids", tuple)
ADDRESS = web.AppKey("address", list)  # [host, port], filled by ``serve`` once bound


class Completer(Protocol):
    """The decode proxy (``server/proxy.py``) as the app sees it."""

    async def complete(
        self, request: web.Request, req: GenerateRequest, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse: ...

    def unready_reason(self) -> str | None: ...

    def check(self, req: GenerateRequest) -> None:
        """``BadRequest`` for what the decode server cannot answer."""


PROXY = web.AppKey("proxy", Completer)  # the decode proxy, if there is one
