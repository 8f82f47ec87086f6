"""The routers people run today, reimplemented as choice rules of the same pool.

Each is a ``Scheduler``: the candidates (ACTIVE workers that can hold the request),
the FIFO queues, the reservation of E_iw at the chosen worker with its reusable
prefix, the caches and the service times are the pool's; only the choice differs.
What a rule reads, in this pool's terms:

    load          requests outstanding at the worker: queued plus the one running
    prefix match  Dynamo: P_iw, the whole blocks of the request's prefix the worker
                  holds (the trie's confirmed holders, as its KV events report);
                  SGLang and llm-d: their own routing-time index (below);
                  the host tier: Dynamo credits its hits (its
                  ``--router-host-cache-hit-weight``); SGLang's and llm-d's
                  routing-time indexes do not see it. Every router's prefills load
                  from the tier alike (the pool's, not the router's)
    cached        the blocks the worker's cache holds (the trie), against its
                  capacity, ``kv_blocks_per_rank`` x its degree

``sglang-cache-aware``: SGLang's router, ``cache_aware`` policy (now the SGLang
Model Gateway; its "Cache-Aware Routing" documentation, 2025, as published by the
gateway's maintainers, lightseekorg/smg ``docs/concepts/routing/cache-aware.md``).
When the
load is imbalanced, ``max - min > balance_abs_threshold`` and ``max >
balance_rel_threshold * min``, the least-loaded worker; otherwise the worker with
the highest prefix-match ratio (matched / input length) if that ratio exceeds
``cache_threshold``, else the worker with the most free cache (the gateway: the
smallest approximate tree). Defaults as the gateway documents them: 0.3, 64, 1.5.
Its prefix index is its own, as the gateway's approximate radix tree is: a
request's blocks join the chosen worker's index when it is routed (so a burst
spreads), each index kept to the worker's KV capacity. Adapted: the tree of request
text becomes blocks of tokens, and "smallest tree" the most free room in the index
(capacity minus size), since workers of different degrees have different room.

``dynamo-kv``: NVIDIA Dynamo's KV router (docs of its router, v0.4 to v1.2:
``--router-kv-overlap-score-weight``, default 1; ``--router-temperature``, default
0). Cost per worker = ``overlap_score_weight`` x the request's blocks to prefill
there (its blocks minus those cached at the worker, and minus
``host_cache_hit_weight``, default 0.75, times those its host tier holds after
them) + the worker's active blocks
(the blocks of the requests outstanding there); the lowest cost wins at
temperature 0 (ties: the lower worker id), else a softmax over -cost / temperature,
seeded. Adapted: active blocks are the outstanding prompts' blocks, as a prefill
worker holds no decode state. (Read: the KV Router pages of Dynamo's docs, v0.4.0
and v1.2.x.)

``llm-d``: the llm-d inference scheduler's default profile (the EPP "Request
Scheduler" docs of llm-d v0.8: filter, score, pick; Red Hat OpenShift AI 3.4,
"Configuring scheduler settings": the default profile weighs queue depth 2 and
prefix-cache hits 3). The kv-cache-utilization scorer, which those pages do not
weigh, runs here at 2, the queue scorer's weight. Each scorer gives [0, 1], the
weighted sum is the score, the highest wins (ties: the lower worker id):

    prefix-cache          matched blocks / the request's blocks, from its own index
                          (the request's blocks join the chosen worker's at routing,
                          as llm-d's approximate prefix plugin does)
    queue                 (max_q - q_w) / (max_q - min_q) over the candidates, with
                          q the requests waiting (queued); 1 when all are equal
    kv-cache-utilization  1 - cached blocks / capacity

Pure Python.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from vertumnus.policy.lattice import LatticeWorker
from vertumnus.policy.placement.baselines import _Baseline
from vertumnus.policy.placement.queues import PlacementRequest


class _Peer(_Baseline):
    """What the peers read of a worker. SGLang's and llm-d's prefix indexes are their
    own and approximate: a request's blocks count as the chosen worker's as soon as
    it is routed there (``routed``), each worker's index kept to its KV capacity
    (least recently routed out first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routed: dict[int, OrderedDict[int, None]] = {}  # worker -> its index
        # worker -> the blocks of its outstanding prompts (queued and running), kept
        # as requests are reserved and forgotten: a sum over the queue per candidate
        # and placement made a long queue quadratic
        self._active: dict[int, int] = {}

    def routed_match(self, worker_id: int, block_ids: tuple[int, ...]) -> int:
        """Leading blocks of the request in the worker's routing index."""
        index = self._routed.get(worker_id)
        n = 0
        if index:
            while n < len(block_ids) and block_ids[n] in index:
                n += 1
        return n

    def routed_size(self, worker_id: int) -> int:
        return len(self._routed.get(worker_id, ()))

    def route(self, worker: LatticeWorker, block_ids: tuple[int, ...]) -> LatticeWorker:
        """Insert the request's blocks into the chosen worker's index."""
        index = self._routed.setdefault(worker.worker_id, OrderedDict())
        for block in block_ids:
            index[block] = None
            index.move_to_end(block)
        room = self.capacity_blocks(worker)
        while room is not None and len(index) > room:
            index.popitem(last=False)
        return worker

    def load(self, worker_id: int) -> int:
        """Requests outstanding: queued plus the one running."""
        return len(self._queue.get(worker_id, ())) + (worker_id in self._running)

    def waiting(self, worker_id: int) -> int:
        return len(self._queue.get(worker_id, ()))

    def cached_blocks(self, worker_id: int) -> int:
        if self.cache is None:
            return 0
        return len(self.cache.trie.worker_nodes.get(worker_id, ()))

    def capacity_blocks(self, worker: LatticeWorker) -> int | None:
        per_rank = self.config.kv_blocks_per_rank
        return None if per_rank is None else per_rank * worker.cp_degree

    def block_tokens(self) -> int:
        return self.cache.trie.block_tokens if self.cache is not None else 1

    def active_blocks(self, worker_id: int) -> int:
        """The blocks of the prompts outstanding at the worker."""
        return self._active.get(worker_id, 0)

    def _blocks_of(self, request: PlacementRequest) -> int:
        """The request's prompt in whole blocks (the last one partial)."""
        return -(-request.input_tokens // self.block_tokens())

    def _reserve(
        self, request: PlacementRequest, worker_id: int, exec_s: float, held_tokens: int = 0
    ) -> None:
        super()._reserve(request, worker_id, exec_s, held_tokens)
        self._active[worker_id] = self._active.get(worker_id, 0) + self._blocks_of(request)

    def _forget(self, request_id: int) -> PlacementRequest:
        worker_id = self._where[request_id]
        request = super()._forget(request_id)
        left = self._active[worker_id] - self._blocks_of(request)
        if left:
            self._active[worker_id] = left
        else:
            del self._active[worker_id]
        return request

    def check(self, now: float) -> None:
        super().check(now)
        active: dict[int, int] = {}
        for request_id, worker_id in self._where.items():
            blocks = self._blocks_of(self._requests[request_id])
            active[worker_id] = active.get(worker_id, 0) + blocks
        assert {w: n for w, n in active.items() if n} == self._active, "active blocks drifted"


class SGLangCacheAwareScheduler(_Peer):
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        blocks = request.block_ids
        loads = {w.worker_id: self.load(w.worker_id) for w in candidates}
        high, low = max(loads.values()), min(loads.values())
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return self.route(
                min(candidates, key=lambda w: (loads[w.worker_id], w.worker_id)), blocks
            )
        matched = {w.worker_id: self.routed_match(w.worker_id, blocks) for w in candidates}
        best = max(candidates, key=lambda w: (matched[w.worker_id], -w.worker_id))
        ratio = matched[best.worker_id] * self.block_tokens() / request.input_tokens
        if ratio > self.cache_threshold:
            return self.route(best, blocks)

        def free(w: LatticeWorker) -> float:
            room = self.capacity_blocks(w)
            held = self.routed_size(w.worker_id)
            return -held if room is None else room - held

        return self.route(max(candidates, key=lambda w: (free(w), -w.worker_id)), blocks)


class DynamoKVScheduler(_Peer):
    overlap_score_weight = 1.0
    host_cache_hit_weight = 0.75  # its credit for a host (CPU offload) tier's overlap
    temperature = 0.0
    seed = 0
    _rng: random.Random | None = None

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        b = self.block_tokens()
        blocks = self._blocks_of(request)

        def cost(w: LatticeWorker) -> float:
            held = reuse.get(w.worker_id, 0)
            host = self.tier_blocks(w, request, held, now)  # its host tier's run after it
            prefill = blocks - held // b - self.host_cache_hit_weight * host
            return self.overlap_score_weight * prefill + self.active_blocks(w.worker_id)

        costs = {w.worker_id: cost(w) for w in candidates}
        if self.temperature <= 0:
            return min(candidates, key=lambda w: (costs[w.worker_id], w.worker_id))
        if self._rng is None:  # (seeded at the first sampled choice: ``seed`` may be set)
            self._rng = random.Random(self.seed)
        low = min(costs.values())
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        weights = [math.exp(-(costs[w.worker_id] - low) / self.temperature) for w in ordered]
        return self._rng.choices(ordered, weights)[0]


class LLMDScheduler(_Peer):
    prefix_weight = 3.0
    queue_weight = 2.0
    kv_utilization_weight = 2.0

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        blocks = max(1, self._blocks_of(request))
        waiting = {w.worker_id: self.waiting(w.worker_id) for w in candidates}
        high, low = max(waiting.values()), min(waiting.values())

        def score(w: LatticeWorker) -> float:
            prefix = self.routed_match(w.worker_id, request.block_ids) / blocks
            queue = 1.0 if high == low else (high - waiting[w.worker_id]) / (high - low)
            room = self.capacity_blocks(w)
            used = 0.0 if not room else min(1.0, self.cached_blocks(w.worker_id) / room)
            return (
                self.prefix_weight * prefix
                + self.queue_weight * queue
                + self.kv_utilization_weight * (1.0 - used)
            )

        return self.route(
            max(candidates, key=lambda w: (score(w), -w.worker_id)), request.block_ids
        )


PEER_ROUTERS: dict[str, type[_Peer]] = {
    "sglang-cache-aware": SGLangCacheAwareScheduler,
    "dynamo-kv": DynamoKVScheduler,
    "llm-d": LLMDScheduler,
}
