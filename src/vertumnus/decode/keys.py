"""What the decode server's app keeps (aiohttp ``AppKey``s): its settings
(``DecodeSettings``), the tokenizer, what requests are checked against
(``Served``), and what lives as long as the app (``Resources``: the decode thread,
the client session to the prefill pool)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from aiohttp import web

from vertumnus.config import ModelConfig
from vertumnus.decode.kv_client import DEFAULT_TIMEOUT_S, PREFILL_TIMEOUT_S
from vertumnus.decode.loop import DecodeLoop
from vertumnus.protocol.request import Served
from vertumnus.protocol.tokenizer import Tokenizer


@dataclass(frozen=True)
class DecodeSettings:
    """What the app needs besides the engine. ``prefill_url`` None: every request
    must bring ``kv_transfer_params``; ``prefill_key``: the bearer sent to the pool
    for prefills and pulls; ``api_key``: guards ``/v1/*`` here; ``served_model``:
    the name a request's ``model`` must be (the pool's; empty: the model's own)."""

    model: ModelConfig
    served_model: str = ""
    eos_token_ids: tuple[int, ...] = ()
    prefill_url: str | None = None
    prefill_key: str | None = None
    api_key: str | None = None
    pool_timeout_s: float = DEFAULT_TIMEOUT_S  # connect, and between two reads of a pull
    # How the KV travels: "http" (the pull stream) or "dist" (the pool's ranks send it
    # point to point; ``dist_host``: this server's address as they reach it)
    transport: str = "http"
    dist_host: str = "127.0.0.1"
    prefill_timeout_s: float = PREFILL_TIMEOUT_S  # for the answer of a prefill we ask for

    def __post_init__(self) -> None:
        if not self.served_model:
            object.__setattr__(self, "served_model", self.model.name)


SETTINGS = web.AppKey("settings", DecodeSettings)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
SERVED = web.AppKey("served", Served)


@dataclass
class Resources:
    """What lives as long as the app: the decode thread (started with the app,
    closed at its cleanup) and the client session to the prefill pool."""

    decode: DecodeLoop
    session: aiohttp.ClientSession | None = None

    def pool_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the app has not started")
        return self.session


RESOURCES = web.AppKey("resources", Resources)
