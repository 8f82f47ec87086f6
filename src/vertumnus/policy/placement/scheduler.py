"""Placement: every request to one worker, by predicted cost (docs/scheduling.md,
"Placement").

Candidates W_i: ACTIVE workers that can hold the request (its KV per rank within
``max_tokens_per_rank``). A prefix miss does not exclude. For w in W_i, with P_iw
the request's prefix reusable at w (whole blocks: the confirmed replicas the
prefix-cache manager knows, or longer where it is coming, below) and
E_iw = E_{C_w}(L_i - P_iw, P_iw):

    cost(i, w) = q_w + (beta + lambda * (C_w / C_min - 1) + kappa * (n_min - 1)+) * E_iw

q_w is the worker's outstanding predicted work at ``now``: its queue plus what is
left of the prefill it runs (its elapsed seconds counted at the pace measured,
``costs.Pace``: the profile's seconds, as the queue's). The minimum wins; ties go
to the lower q_w, then the lower degree, then the lower worker id. E_iw is reserved
on w at once, so the next arrival sees it (the queues: ``queues``).

The backlog term (``CostWeights.backlog_weight``, kappa): n_min is the fewest
requests waiting (placed, not started) at any candidate. While some worker has at
most one request waiting, the term is 0 and the rule balances queues. In overload
every worker has a queue, so no placement leaves a worker idle, and each second of
E_iw also delays the requests that will queue behind it (about n_min - 1 of them:
the shortest queue's, less the one next in line): the work a placement saves (a
hit, a faster degree) is worth that many times more than the wait it costs the
request itself. Without it, near saturation the load term scatters prefixes and
the pool loses throughput to recomputation (the cost rule's known weakness).

Pulls (``pull_cost`` set: the cache manager pulls, ``cache.copy_cost``): w may also reuse
the request's whole MatchedPath P*, copied from a holder while w works off its
queue, with ``pull_s`` the copy's predicted wait and ``evict_s`` the future prefill
time of what it must evict at w:

    cost_pull(i, w) = q_w + max(0, pull_s - q_w) + (beta + lambda * (C_w / C_min - 1))
                      * E_Cw(L - P*, P*) + evict_s

The cheaper of the two prices w; a pull shows in the placement as ``reused_tokens``
above what w holds, and the policy stack queues the copy.

Coming prefixes (``SchedulerConfig.coming_reuse``): P_iw is what w holds, or longer
where the requests outstanding at w bring more of the request's prefix: FIFO, they
write it before the request starts (``coming``). Only what w holds or pulls is
reported to the cache manager.

Pure Python, clock-free: ``now`` is an argument. Not owned here: the workers' FIFO
queues and the reservations (``queues``, which ``Scheduler`` extends), the
composition (``lattice``), when to reshape it (``control``), the trie
(``cache.manager``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from vertumnus.blocks import max_reuse_blocks
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.coming import coming_run
from vertumnus.policy.cache.host_slots import sweep
from vertumnus.policy.cache.host_tier import HostTierPolicy
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.nodes import Node
from vertumnus.policy.cache.plans import RequestUpdate
from vertumnus.policy.costs import CostWeights, reuse_curves
from vertumnus.policy.lattice import Lattice, LatticeWorker, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest, SchedulerError, WorkerQueues

__all__ = ["Choice", "Placement", "Scheduler", "SchedulerConfig"]

# (worker id, its degree, P_iw, E_iw, q_w, cost, the part of P_iw the worker holds
# or pulls: the rest is coming there)
Choice = tuple[int, int, int, float, float, float, int]


@dataclass(frozen=True)
class SchedulerConfig:
    weights: CostWeights = field(default_factory=CostWeights)
    # KV room of one rank in tokens: a degree-C worker holds a request of L tokens if
    # ceil(L / C) <= this. None: no limit.
    max_tokens_per_rank: int | None = None
    # KV blocks of one rank (the peer routers read a worker's free cache); None: unknown
    kv_blocks_per_rank: int | None = None
    # P_iw counts the blocks the requests outstanding at w bring (module docstring)
    coming_reuse: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise SchedulerError("max_tokens_per_rank must be >= 1")


@dataclass(frozen=True)
class Placement:
    request_id: int
    worker_id: int
    cp_degree: int
    reused_tokens: int  # P_iw
    exec_s: float  # E_iw, reserved on the worker
    queue_s: float  # q_w when placed
    cost: float
    num_candidates: int
    update: RequestUpdate | None  # the cache manager's per-request result
    # (worker, reusable tokens > 0) of every worker that could serve a prefix
    holders: tuple[tuple[int, int], ...] = ()


class Scheduler(WorkerQueues):
    reads_coming = True  # (a baseline router's own rule does not read coming reuse)

    def __init__(
        self,
        lattice: Lattice,
        coeffs: Mapping[int, DegreeCoeffs],
        config: SchedulerConfig | None = None,
        cache: PrefixCacheManager | None = None,
    ) -> None:
        missing = set(lattice.config.degrees) - set(coeffs)
        if missing:
            raise SchedulerError(f"the profile has no coefficients for degrees {sorted(missing)}")
        super().__init__(lattice)
        self.config = config or SchedulerConfig()
        self.cache = cache
        self.curves = reuse_curves(coeffs)
        self.counts_coming = self.config.coming_reuse and self.reads_coming
        # (MatchedPath, blocks to copy, destination, now) -> (predicted seconds until a
        # pull of them lands, the future prefill seconds its evictions cost); None: no
        # pulls (set by the policy stack when its cache manager pulls).
        self.pull_cost: Callable[[Sequence[Node], int, int, float], tuple[float, float]] | None = (
            None
        )
        # The host tier (set by the policy stack when it has one): a run of the
        # request's blocks in the worker's host tier, after what the worker holds, is
        # priced at its load-back time (``tier_blocks``).
        self.tiers: HostTierPolicy | None = None
        self._tier_reuse: dict[int, int] = {}  # worker -> P with its tier run, this request

    # -- placement -------------------------------------------------------------------

    def place(self, request: PlacementRequest, now: float) -> Placement | None:
        """Choose and reserve a worker; None when no worker can take the request."""
        if request.request_id in self._where:
            raise SchedulerError(f"request {request.request_id} is already placed")
        n = request.input_tokens
        if n < 1:
            raise SchedulerError(f"request {request.request_id}: input_tokens must be >= 1")
        limit = self.config.max_tokens_per_rank
        candidates = [
            w
            for w in self.lattice.workers.values()
            if w.state is WorkerState.ACTIVE and (limit is None or -(-n // w.cp_degree) <= limit)
        ]
        if not candidates:
            return None
        lookup = None
        reuse: Mapping[int, int] = {}
        matched: Sequence[Node] = ()
        if self.cache is not None and request.block_ids:
            lookup = self.cache.lookup(request.block_ids, n)
            reuse, matched = lookup.reusable_tokens, lookup.path
        self._tier_reuse = {}
        choice = self._choose(request, candidates, reuse, now, matched)
        worker_id, c, reused, exec_s, q, cost, counted = choice
        self._reserve(request, worker_id, exec_s, reuse.get(worker_id, 0))
        update = None
        if self.cache is not None and request.block_ids:
            update = self.cache.on_request(request.block_ids, n, worker_id, lookup, counted, now)
        holders = tuple((w, p) for w, p in reuse.items() if p > 0)
        if self._tier_reuse:  # (the what-if replay sees a tier hit as a hit)
            merged = dict(holders)
            for w, p in self._tier_reuse.items():
                merged[w] = max(p, merged.get(w, 0))
            holders = tuple(merged.items())
        return Placement(
            request.request_id,
            worker_id,
            c,
            reused,
            exec_s,
            q,
            cost,
            len(candidates),
            update,
            holders,
        )

    def _block(self) -> int:
        return self.cache.trie.block_tokens if self.cache is not None else 1

    def coming_tokens(self, worker_id: int, request: PlacementRequest, held: int = 0) -> int:
        """Tokens of the request's leading blocks that the worker holds (``held``
        tokens, from the trie) or that the requests outstanding there bring (at most
        the blocks it may reuse)."""
        coming = self.coming.by_worker.get(worker_id)
        if coming is None:
            return held
        ids, b = request.block_ids, self._block()
        usable = min(len(ids), max_reuse_blocks(request.input_tokens, b))
        return coming_run(coming, ids, held // b, usable) * b

    def tier_blocks(
        self, w: LatticeWorker, request: PlacementRequest, held_tokens: int, now: float
    ) -> int:
        """Blocks of the request after the ``held_tokens`` the worker has that its host
        tier holds (0 without a tier)."""
        tiers = self.tiers
        if tiers is None or not tiers.enabled or not request.block_ids:
            return 0
        ids, b = request.block_ids, self._block()
        usable = min(len(ids), max_reuse_blocks(request.input_tokens, b))
        return tiers.run(w.first_device, ids, held_tokens // b, usable, now)

    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
        matched: Sequence[Node] = (),
    ) -> Choice:
        """The cost rule of the module docstring (``matched``: the MatchedPath, whose
        length is P*, for pulls). Baseline routers override this."""
        n = request.input_tokens
        pull_cost = self.pull_cost if matched else None
        block = self._block()
        coming = self.coming.by_worker
        ids = request.block_ids
        usable = min(len(ids), max_reuse_blocks(n, block))
        matched_tokens = len(matched) * block
        min_degree = min(w.cp_degree for w in candidates)
        weights = self.config.weights
        factor = {c: weights.factor(c, min_degree) for c in self.curves}
        if weights.backlog_weight > 0:  # overload: E_iw delays the n_min - 1 behind
            queues, n_min = self._queue, math.inf
            for w in candidates:  # (stops at the first worker with at most one)
                waiting = len(queues.get(w.worker_id, ()))
                if waiting < n_min:
                    n_min = waiting
                    if waiting <= 1:
                        break
            if n_min > 1:
                extra = weights.backlog_weight * (n_min - 1)
                factor = {c: f + extra for c, f in factor.items()}
        times: dict[tuple[int, int], float] = {}
        queued, running = self._queued_s, self._running
        pace, pooled = self.pace.by_degree, self.pace.pooled
        best_key: tuple[float, float, int, int] | None = None
        reused = counted = 0
        tiers = self.tiers if self.tiers is not None and self.tiers.enabled and ids else None
        from_0: dict[int, int] = {}  # host -> its tier's run from depth 0 (made once)
        in_tiers, masks = (0, []) if tiers is None else tiers.holding(ids, usable)
        if not in_tiers:  # (no host's tier holds any of it)
            tiers = None
        # (C, P, own host's run, the run with other hosts') -> (blocks loaded, E + load)
        loaded_e: dict[tuple[int, int, int, int], tuple[int, float]] = {}
        floor_e: dict[int, float] = {}  # E at the longest reuse: a bound on a load's worth
        if tiers is not None:
            floor_e = {c: curve.time_s(n, usable * block) for c, curve in self.curves.items()}
        exec_s = 0.0
        for w in candidates:
            worker_id, c = w.worker_id, w.cp_degree
            p = held = reuse.get(worker_id, 0)
            brought = coming.get(worker_id)  # (``coming_tokens``, inline)
            if brought is not None:
                p = coming_run(brought, ids, held // block, usable) * block
            e = times.get((c, p))
            if e is None:
                e = times[(c, p)] = self.curves[c].time_s(n, p)
            # q_w, as ``outstanding_s`` computes it
            q = queued.get(worker_id, 0.0)
            run = running.get(worker_id)
            rate = pace.get(c, pooled)  # (real seconds into the profile's)
            if run is not None:
                q += max(0.0, run.exec_s - (now - run.start_s) * rate)
            cost = q + factor[c] * e
            if tiers is not None and (
                best_key is None or q + factor[c] * floor_e[c] <= best_key[0]
            ):  # a run in the tiers, priced at its load (``_tier_price``)
                found, e2 = self._tier_price(w, c, n, p, masks, in_tiers, from_0, loaded_e)
                if found and q + factor[c] * e2 < cost:
                    p, e, cost = p + found * block, e2, q + factor[c] * e2
                    self._tier_reuse[worker_id] = p
            if pull_cost is not None and matched_tokens > p:
                pulled = times.get((c, matched_tokens))
                if pulled is None:
                    pulled = times[(c, matched_tokens)] = self.curves[c].time_s(n, matched_tokens)
                # A pull costs at least q + factor * E at the match (its wait and its
                # evictions add): priced only where that could beat this worker's cost
                # and the best so far (most of a large pool's workers cannot).
                least = q + factor[c] * pulled
                if least < cost and (best_key is None or least <= best_key[0]):
                    delay_s, evict_s = pull_cost(
                        matched, (matched_tokens - held) // block, worker_id, now
                    )
                    pull = q + max(0.0, delay_s * rate - q) + factor[c] * pulled + evict_s
                    if pull < cost:
                        p = held = matched_tokens
                        e, cost = pulled, pull
            if best_key is None or cost <= best_key[0]:
                key = (cost, q, c, worker_id)
                if best_key is None or key < best_key:
                    best_key, reused, exec_s, counted = key, p, e, held
        assert best_key is not None
        cost, q, c, worker_id = best_key
        return worker_id, c, reused, exec_s, q, cost, counted

    def _tier_price(
        self,
        w: LatticeWorker,
        c: int,
        n: int,
        p: int,
        masks: Sequence[int],
        in_tiers: int,
        from_0: dict[int, int],
        loaded_e: dict[tuple[int, int, int, int], tuple[int, float]],
    ) -> tuple[int, float]:
        """The blocks after the worker's ``p`` tokens that the tiers hold, and E of the
        longer prefix plus their load: its host's run, or (``HostTierPolicy.remote``) the
        run with other hosts' blocks read over the network, whichever costs less
        (0 blocks: none). ``masks``: per block, the hosts holding it; ``from_0`` (every
        host's run from depth 0, one sweep) and ``loaded_e``: this request's memos."""
        tiers = self.tiers
        assert tiers is not None
        block = self._block()
        host = tiers.host_of(w.first_device)
        start, end, bit = p // block, len(masks), 1 << host
        local = 0
        if in_tiers & bit:
            if p:  # (a worker's own start: its host's run alone)
                d = start
                while d < end and masks[d] & bit:
                    d += 1
                local = d - start
            else:  # (most workers start at 0: every host's run in one sweep)
                if not from_0:
                    from_0.update(sweep(masks, 0, in_tiers))
                local = from_0.get(host, 0)
        anywhere = local
        if tiers.remote:
            d = start + local
            while d < end and masks[d]:
                d += 1
            anywhere = d - start
        key = (c, p, local, anywhere)
        priced = loaded_e.get(key)
        if priced is None:
            options = ((local, 0), (anywhere, anywhere - local))
            run, e, _ = tiers.cheapest(self.curves[c], n, p, block, c, options)
            priced = loaded_e[key] = (run, e)
        return priced

    def _reserve(
        self, request: PlacementRequest, worker_id: int, exec_s: float, held_tokens: int = 0
    ) -> None:
        """E_iw reserved at the worker; the request's blocks past the ``held_tokens``
        its worker holds (or pulls) count as coming there, where the rule reads them."""
        first = held_tokens // self._block() if self.counts_coming else None
        self._enqueue(request, worker_id, exec_s, first)
