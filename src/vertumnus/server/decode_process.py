"""The local decode process (``[decode] local``, the default): ``python -m vertumnus
decode`` started beside the pool in the background, serving the model under the
pool's name (``--served-model-name``), told the hand-off secret, and
restarted with backoff whenever it dies or fails to start; ``state`` says why it is
not up meanwhile (``/ready`` reports it), and the pool serves prefills all along.
It does not forward completions: ``proxy.py`` does, to the address ``wait_up``
gives (``url`` changes under any ``await``: read it once, then use what was read)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass

import structlog

from vertumnus.config import EngineConfig
from vertumnus.runtime.serve_tables import DecodeConfig

log = structlog.get_logger("vertumnus.proxy")


@dataclass(frozen=True)
class DecodeTarget:
    """Where a decode server listens, and which of the local process's lives it is
    (0: a separate server, which has no lives here)."""

    url: str
    generation: int = 0


START_TIMEOUT_S = 120.0  # a local decode process's start (it imports torch, builds the model)
STABLE_S = 30.0  # a decode process up this long had served: its restart backoff starts over


class LocalDecode:
    """One local decode process at a time, supervised from ``start`` to ``close``."""

    def __init__(
        self,
        cfg: DecodeConfig,
        engine: EngineConfig,
        model: str,
        secret: str,
        served_model: str | None = None,
    ) -> None:
        """``model``: the preset or folder to load; ``served_model``: the name that
        requests' ``model`` must give, the pool's (default: ``model``); ``secret``:
        the hand-off secret, with which the process pulls the KV."""
        self.cfg, self.engine, self.model, self.secret = cfg, engine, model, secret
        self.served_model = served_model if served_model is not None else model
        self.url: str | None = None  # where the process listens (None: not up)
        self.process: asyncio.subprocess.Process | None = None  # the latest one
        self.restarts = 0
        self.state = "the local decode process is starting"  # why it is not up
        self._prefill_url = ""
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self._up = asyncio.Event()  # set while ``url`` is not None (or closing: no wait)
        self._down = asyncio.Event()  # set while it is not (or closing)
        self._down.set()
        self.generation = 0  # one more at each process that comes up

    def start(self, prefill_url: str) -> None:
        """``prefill_url``: where the pool listens, for the process's pulls."""
        self._prefill_url = prefill_url
        self._supervisor = asyncio.create_task(self._supervise())

    def current(self) -> DecodeTarget | None:
        """Where the process listens now, and which one it is (None: not up)."""
        if self.url is None or self._closing:
            return None
        return DecodeTarget(self.url, self.generation)

    async def wait_up(self, timeout_s: float) -> DecodeTarget | None:
        """``current()``: now if the process is up, else once it is back (a restart),
        waiting at most ``timeout_s``; None if it is not back by then, or is being
        closed."""
        if self.url is None and not self._closing and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), timeout_s)
        return self.current()

    async def gone(self, target: DecodeTarget, within_s: float) -> bool:
        """Whether the process at ``target`` has exited, waiting up to ``within_s``
        for its exit to be seen (a killed process's connections are reset a moment
        before its supervisor sees it exit)."""
        if self.current() == target and within_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._down.wait(), within_s)
        return self.current() != target

    # The supervisor's two transitions (and a test's, which has no process).
    def _mark_up(self, url: str, process: asyncio.subprocess.Process | None) -> None:
        self.url, self.process = url, process
        self.generation += 1
        self._down.clear()
        self._up.set()

    def _mark_down(self) -> None:
        self.url = None
        self._down.set()
        if not self._closing:
            self._up.clear()

    def command(self) -> list[str]:
        """The process's command line (the pool's address once ``start`` gave it)."""
        engine = self.engine
        return [
            sys.executable,
            "-m",
            "vertumnus",
            "decode",
            "--prefill",
            self._prefill_url,
            "--port",
            "0",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model,
            "--seed",
            str(engine.seed),
            "--dtype",
            engine.dtype,
            "--device",
            engine.device,
            "--parent-pid",
            str(os.getpid()),
            "--transport",
            self.cfg.transport,
        ]

    async def _spawn(self) -> None:
        argv = self.command()
        # Told the hand-off secret; its own API (local, loopback only) stays open.
        env = {**os.environ, "VERTUMNUS_PREFILL_KEY": self.secret}
        env.pop("VERTUMNUS_DECODE_API_KEY", None)
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env
        )
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError("the local decode process did not start in time") from None
        text = line.decode().strip()
        if "http://" not in text:
            code = await process.wait()
            said = f": {text!r}" if text else ""
            raise RuntimeError(f"the local decode process exited with code {code}{said}")
        self._mark_up(text[text.index("http://") :], process)
        log.info("decode_started", url=self.url, pid=process.pid, restarts=self.restarts)

    async def _supervise(self) -> None:
        """Start the local decode process, and again whenever it ends or fails to
        start (until ``close``): after ``restart_s``, doubling while it keeps failing,
        up to ``restart_max_s``. The pool serves prefills meanwhile."""
        delay = self.cfg.restart_s
        while not self._closing:
            began = time.monotonic()
            try:
                await self._spawn()
                assert self.process is not None
                code = await self.process.wait()
                if self._closing:
                    return
                self._mark_down()
                log.error("decode_exited", pid=self.process.pid, code=code, retry_in_s=delay)
                if time.monotonic() - began > STABLE_S:
                    delay = self.cfg.restart_s  # it had served a while: not a crash loop
                what = f"exited with code {code}"
            except Exception as exc:  # (a start that failed, or a bug here: retried)
                log.error("decode_start_failed", error=str(exc), retry_in_s=delay, exc_info=exc)
                what = f"failed to start ({exc})"
            self.state = f"the local decode process {what}; it restarts in {delay:g} s"
            await asyncio.sleep(delay)
            self.restarts += 1
            self.state = "the local decode process is restarting"
            delay = min(self.cfg.restart_max_s, max(2 * delay, 1.0))

    async def close(self) -> None:
        self._closing = True
        self._up.set()  # (whoever waits for the process: it is not coming back)
        self._down.set()
        self.url = None
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
