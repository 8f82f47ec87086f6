"""What the REST app keeps (aiohttp ``AppKey``s): the coordinator, the tokenizer, the
address the server listens on once bound, and the decode proxy when there is one."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from vertumnus.runtime.coordinator import Coordinator
from vertumnus.server.tokenizer import Tokenizer

COORDINATOR = web.AppKey("coordinator", Coordinator)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
ADDRESS = web.AppKey("address", list)  # [host, port], filled by ``serve`` once bound


class Completer(Protocol):
    """The decode proxy (``server/proxy.py``) as the app sees it."""

    async def complete(
        self, request: web.Request, body: dict[str, Any], tokens: list[int]
    ) -> web.StreamResponse: ...

    def unready_reason(self) -> str | None: ...


PROXY = web.AppKey("proxy", Completer)  # the decode proxy, if there is one
