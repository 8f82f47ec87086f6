"""What the vLLM connector (``connector.py``) decides and moves, without vLLM:

- ``plan``: how many of a request's prompt tokens the pool's KV supplies, given its
  ``kv_transfer_params`` and the tokens vLLM's own prefix cache already holds (the
  pool exports every prompt token but the last, which vLLM computes itself);
- ``slot_mapping``: where those tokens go in vLLM's paged cache (slot = block id x
  block size + offset, the mapping every attention backend's cache write takes; a
  block id of -1, vLLM's null block past a sliding window, gives negative slots:
  nothing to write);
- ``Loader``: the pulls, each on a thread of its own (``decode/kv_pull.py``, which
  ends the pool's lease), their KV handed to the caller's thread to be written,
  and the blocks of a pull that failed, which vLLM then recomputes.

Pure torch and threads; the connector gives it vLLM's pieces.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import Tensor

from vertumnus.decode.kv_client import TransferParams, release
from vertumnus.decode.kv_pull import PulledKV, pull
from vertumnus.kv_wire import HandoffError

log = structlog.get_logger("vertumnus.vllm")


@dataclass(frozen=True)
class Load:
    """One request's KV to bring in: tokens [first, first + count) of its prompt,
    into its blocks (the request's whole block table, in order; -1 for a null block).
    ``groups``: the block table of each of vLLM's KV cache groups when it has several
    (its hybrid allocator keeps one per attention kind, e.g. gpt-oss's full and
    sliding layers); ``block_ids`` is the first."""

    req_id: str
    transfer: TransferParams
    first: int
    count: int
    block_ids: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()


def plan(params: Any, prompt_len: int, num_computed: int) -> tuple[TransferParams | None, int]:
    """The pool's KV for a request: its transfer params and how many tokens past
    ``num_computed`` (those vLLM's prefix cache holds) it supplies; (None, 0) for a
    request without them. ``ValueError``: params that do not fit the prompt."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return None, 0
    transfer = TransferParams.parse(dict(params))
    if transfer.num_tokens != prompt_len - 1:
        raise ValueError(
            f"kv_transfer_params of {transfer.num_tokens} tokens for a prompt of "
            f"{prompt_len}: the pool exports all but the last"
        )
    return transfer, max(0, transfer.num_tokens - num_computed)


def slot_mapping(block_ids: tuple[int, ...], block_size: int, first: int, count: int) -> Tensor:
    """Slots of prompt tokens [first, first + count) in a paged cache: [count] int64."""
    positions = torch.arange(first, first + count, dtype=torch.int64)
    needed = (first + count + block_size - 1) // block_size
    if len(block_ids) < needed:
        raise ValueError(f"{len(block_ids)} blocks hold fewer than {first + count} tokens")
    table = torch.tensor(block_ids[:needed], dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def blocks_of(load: Load, block_size: int) -> set[int]:
    """The blocks that tokens [first, first + count) of ``load`` go into (null
    blocks, -1, left out: other requests share vLLM's)."""
    if load.count == 0:
        return set()
    start, end = load.first // block_size, (load.first + load.count - 1) // block_size
    return {b for b in load.block_ids[start : end + 1] if b >= 0}


Write = Callable[[Load, PulledKV], None]


class Loader:
    """Pulls on threads; ``finished`` writes what has arrived on the caller's thread
    (the model runner's, between steps) and says which requests are done and which
    blocks failed to load."""

    def __init__(
        self, token: str | None, timeout_s: float, block_size: int, threads: int = 4
    ) -> None:
        self.token, self.timeout_s, self.block_size = token, timeout_s, block_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vertumnus-pull")
        self._loads: dict[str, tuple[Load, Future[PulledKV]]] = {}
        self._lock = threading.Lock()
        self._failed: set[str] = set()  # requests whose load failed, until taken

    def start(self, load: Load) -> None:
        future = self._pool.submit(self._pull, load.transfer)
        with self._lock:
            self._loads[load.req_id] = (load, future)

    def _pull(self, transfer: TransferParams) -> PulledKV:
        return asyncio.run(
            pull(transfer.base_url, transfer.handle, self.token, timeout_s=self.timeout_s)
        )

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def finished(self, write: Write) -> tuple[set[str], set[int]]:
        """(requests whose load ended, blocks that failed to load): each pull that has
        arrived is written by ``write`` and its buffer given back."""
        with self._lock:
            done = [(r, lf) for r, lf in self._loads.items() if lf[1].done()]
            for req_id, _ in done:
                del self._loads[req_id]
        ended, failed = set(), set()
        for req_id, (load, future) in done:
            ended.add(req_id)
            try:
                pulled = future.result()
            except Exception as exc:  # the pull failed: vLLM recomputes these blocks
                log.warning("kv_pull_failed", request=req_id, error=str(exc))
                failed |= blocks_of(load, self.block_size)
                self._failed.add(req_id)
                continue
            try:
                if pulled.header.num_tokens != load.transfer.num_tokens:
                    raise HandoffError(
                        f"the pulled KV holds {pulled.header.num_tokens} tokens, "
                        f"{load.transfer.num_tokens} were announced",
                        "malformed",
                    )
                write(load, pulled)
            except Exception as exc:
                log.warning("kv_write_failed", request=req_id, error=str(exc))
                failed |= blocks_of(load, self.block_size)
                self._failed.add(req_id)
            finally:
                pulled.release()
        return ended, failed

    def take_failed(self) -> set[str]:
        """The requests whose load failed since the last call (for vLLM with several
        KV cache groups, whose block ids cannot name a request's blocks)."""
        failed, self._failed = self._failed, set()
        return failed

    def release(self, transfer: TransferParams) -> None:
        """Give up a lease nobody will pull (vLLM held every token already)."""
        self._pool.submit(self._release, transfer)

    def _release(self, transfer: TransferParams) -> None:
        try:
            asyncio.run(release(transfer.base_url, transfer.handle, self.token, timeout_s=10.0))
        except HandoffError as exc:
            log.warning("kv_release_failed", handle=transfer.handle, error=str(exc))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
