"""``VertumnusConnector``: a vLLM KV connector (``KVConnectorBase_V1``) for the decode
role, so that a vLLM instance decodes what Vertumnus's prefill pool prefilled::

    vllm serve DIR --kv-transfer-config '{"kv_connector": "VertumnusConnector",
        "kv_connector_module_path": "vertumnus.integrations.vllm",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}'

A request that brings the pool's ``kv_transfer_params`` (``do_remote_prefill``)
has its prompt's KV, but for the last token, loaded asynchronously: the scheduler
side counts those tokens as external (past what vLLM's own prefix cache holds) and
hands the worker side the request's blocks; the worker side pulls the KV over the
pool's hand-off (``loads.py``; the pull ends the pool's lease) and writes it with
the attention backend's own cache write (``do_kv_cache_update``), so the backend's
layout (CPU, CUDA) is never hand-coded. A pull that fails marks its blocks as
failed (or, with several KV cache groups, its request): with
``kv_load_failure_policy = "recompute"`` vLLM computes them itself and the request
completes. It supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model
whose layers differ in attention (gpt-oss: sliding and full layers) has one block
table per KV cache group, and each layer's KV goes into its own group's blocks (none
into the null blocks past a window). Without it vLLM turns that manager off for the
connector, and vLLM CPU 0.32.0 then decodes such a model wrongly with any connector.
The pool's bearer comes from ``kv_connector_extra_config.prefill_key`` or
``$VERTUMNUS_PREFILL_KEY``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vertumnus.decode.kv_pull import PulledKV
from vertumnus.integrations.vllm.loads import Load, Loader, plan, slot_mapping

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

SUPPORTED_VLLM = ("0.32.0",)
log = structlog.get_logger("vertumnus.vllm")
_LAYER = re.compile(r"layers\.(\d+)\.")


def check_version(version: str = vllm.__version__) -> None:
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"VertumnusConnector supports vLLM {', '.join(SUPPORTED_VLLM)}; this is {version}"
        )


# vLLM's classes are Any to mypy (pyproject.toml: vLLM is not in its environment).
@dataclass
class VertumnusMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[Load] = field(default_factory=list)


class VertumnusConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        check_version()
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        token = extra.get("prefill_key") or os.environ.get("VERTUMNUS_PREFILL_KEY") or None
        self.block_size = vllm_config.cache_config.block_size
        self.loader = Loader(token, float(extra.get("timeout_s", 60.0)), self.block_size)
        # The scheduler's side: requests counted as external, and loads to send.
        self._planned: dict[str, tuple[Any, int, int]] = {}  # transfer, first, count
        self._ready: list[Load] = []
        # The worker's side.
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._failed_blocks: set[int] = set()
        # vLLM's KV cache groups (one unless its hybrid manager splits the layers).
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self._group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self._several_groups = len(groups) > 1

    # -- the scheduler's side --------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._planned:
            return 0, False
        try:
            transfer, count = plan(
                request.kv_transfer_params,
                len(request.prompt_token_ids or ()),
                num_computed_tokens,
            )
        except ValueError as exc:
            log.warning("kv_transfer_params_refused", request=request.request_id, error=str(exc))
            return 0, False
        if transfer is None:
            return 0, False
        if count == 0:  # vLLM's own cache holds it all: nobody will pull the lease
            self.loader.release(transfer)
            return 0, False
        self._planned[request.request_id] = (transfer, num_computed_tokens, count)
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        planned = self._planned.get(request.request_id)
        if planned is None or num_external_tokens == 0:
            return
        transfer, first, count = planned
        groups = tuple(tuple(-1 if b.is_null else b.block_id for b in g) for g in blocks.blocks)
        self._ready.append(Load(request.request_id, transfer, first, count, groups[0], groups))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._ready = VertumnusMetadata(self._ready), []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._planned.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # -- the worker's side -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            found = _LAYER.search(name)
            if found is None:
                raise ValueError(f"VertumnusConnector: no layer index in {name!r}")
            return int(found.group(1))

        self._caches = sorted(kv_caches.items(), key=lambda item: index(item[0]))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VertumnusMetadata)
        for load in meta.loads:
            self.loader.start(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: nothing runs before they have landed

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the decode role saves nothing

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended; a failed one by its blocks, or, with several KV cache
        groups (where block ids do not name a request's blocks), by its request."""
        ended, failed = self.loader.finished(self._write)
        failed_requests = self.loader.take_failed()
        if self._several_groups:
            return KVConnectorTransferResults(
                finished_recving=ended, failed_recving=failed_requests
            )
        self._failed_blocks |= failed
        return KVConnectorTransferResults(finished_recving=ended)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _write(self, load: Load, pulled: PulledKV) -> None:
        """The pulled KV of tokens [first, first + count) into the request's blocks,
        layer by layer, by the backend's own cache write."""
        layers = pulled.kv
        if len(layers) != len(self._caches):
            raise ValueError(f"the pool's KV has {len(layers)} layers; vLLM's {len(self._caches)}")
        context = self._vllm_config.compilation_config.static_forward_context
        dtype = self._vllm_config.model_config.dtype  # what the layer's cache write takes
        end = load.first + load.count
        # Per KV cache group: (slots, which of the tokens they hold; None: all).
        by_group: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for table in load.groups or (load.block_ids,):
            mapped = slot_mapping(table, self.block_size, load.first, load.count)
            real = mapped >= 0  # null blocks (past a sliding window) get nothing
            by_group.append((mapped[real], None if bool(real.all()) else real))
        for (name, cache), (k, v) in zip(self._caches, layers, strict=True):
            layer, device = context[name], cache.device
            slots, kept = by_group[self._group_of.get(name, 0)]
            key, value = k[load.first : end], v[load.first : end]
            if kept is not None:
                key, value = key[kept], value[kept]
            key = key.to(device=device, dtype=dtype)
            value = value.to(device=device, dtype=dtype)
            layer.impl.do_kv_cache_update(layer, key, value, cache, slots.to(device))

    def shutdown(self) -> None:
        self.loader.close()
