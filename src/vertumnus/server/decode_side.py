"""Where the decode proxy's decode server is, read at the moment it is used: the
local decode process under its supervisor (``decode_process.py``), or ``[decode]
url``. It says where one listens now (``current``), waits for one to be back
(``wait``), tells whether a forward that failed went to a server that is gone
(``went_away``: then the completion may go to another, ``Undelivered``), and why
none is there (``away``). It forwards nothing and holds no lease: ``proxy.py`` does.

What it answers may change under any ``await``: a caller reads a ``DecodeTarget``
once and uses that, never an attribute read before the wait.
"""

from __future__ import annotations

import asyncio

import aiohttp

from vertumnus.runtime.serve_tables import DecodeConfig
from vertumnus.server.decode_process import DecodeTarget, LocalDecode

EXIT_SEEN_S = 2.0  # how long after a failed forward the local process's exit may take to be seen


class Undelivered(RuntimeError):
    """The decode server went away before any of the completion came back, and will
    never answer it: it refused the connection, or (the local process) it died. The
    client has had nothing; the leases are as the decode server left them (a pull
    that failed leaves its lease open)."""


class DecodeSide:
    """Given ``[decode]`` and the local decode process's supervisor (None: a
    separate server at ``cfg.url``, or none)."""

    def __init__(self, cfg: DecodeConfig, local: LocalDecode | None) -> None:
        self.cfg, self.local = cfg, local
        self.closing = False

    @property
    def who(self) -> str:
        return "the local decode process" if self.local is not None else "the decode server"

    def failed(self, exc: BaseException) -> str:
        """The error a decode failure answers with, naming the local decode process
        where it is the decode server (a kill cuts its answers before its exit is
        seen)."""
        return f"{self.who} failed: {exc}"

    def current(self) -> DecodeTarget | None:
        """Where the decode server listens now (None: not up, or closing)."""
        if self.closing:
            return None
        if self.local is not None:
            return self.local.current()
        return None if self.cfg.url is None else DecodeTarget(self.cfg.url)

    async def wait(
        self, deadline: float, undelivered: Undelivered | None, delay: float
    ) -> DecodeTarget | None:
        """Where the decode server listens once it is up again, by ``deadline`` (the
        loop's time); None if not by then. After an undelivered try, first
        ``delay`` (a server that refuses is asked again no faster than that)."""
        loop = asyncio.get_running_loop()
        if undelivered is not None:
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        if self.closing or loop.time() >= deadline:
            return None
        if self.local is not None:
            return await self.local.wait_up(deadline - loop.time())
        return self.current()

    async def went_away(self, target: DecodeTarget, exc: BaseException) -> bool:
        """Whether a forward to ``target`` that failed with ``exc``, before any answer
        came back, never reached a decode server that could still act on it: the
        connection was refused (not a TLS failure: that stays an error), or the
        local process it went to has exited."""
        if isinstance(exc, aiohttp.ClientConnectorError):
            return not isinstance(exc, aiohttp.ClientSSLError)
        return self.local is not None and await self.local.gone(target, EXIT_SEEN_S)

    def away(self, undelivered: Undelivered | None) -> str:
        """Why no decode server took the completion in time."""
        if self.closing:
            return "the server is shutting down"
        if self.local is not None:
            if undelivered is None or self.local.current() is None:
                return self.local.state
            return self.failed(undelivered)
        return f"the decode server at {self.cfg.url} is unreachable ({undelivered})"

    async def close(self) -> None:
        self.closing = True
        if self.local is not None:
            await self.local.close()
