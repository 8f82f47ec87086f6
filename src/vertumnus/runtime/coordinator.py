"""The asyncio coordinator: the pool's policy stack around live rank processes.

The policy is ``PoolPolicy`` (``policy/pool_policy.py``), built by the same factory
and driven the same way as in the simulator; a parity test runs one trace through
both. The coordinator adds asyncio, the ranks and the views, in parts of one job
each. It is their composition root: it builds what they share (``Shared``,
``state.py``: the configuration, the policy, metrics, health, the clock, the ranks
as they are now, the background tasks, the switchboard), then the parts in this order,
each given the parts above it that it uses and never one below it, the coordinator,
or a callback:

    kv/copies.py      the cache manager's scans and copies; a copy job's blocks moved
                      rank to rank (KVTransfer, KVWritten)
    kv/handoffs.py    KV kept for a decode server under leases, and its pull (KVRead)
    rank_link.py      the rank pipes: every answer a rank owes and who waits for it
    recovery.py       a failed rank: its worker out, restarted, back
    request_path.py   an HTTP request's life: placement, its prefill, its answer
    worker_loops.py   one task per worker, running its queue
    reshaping.py      a committed switch carried out on the ranks (SwitchEpoch, acks)
    periodic.py       the one timer: controller windows, cache scans, expiry

beside what they share (background.py: the background tasks, none lost in silence;
health.py: whether the pool serves; kv/host_memory.py: the host tier's bytes) and
what reads them (readiness.py: ``/ready``; views.py: the REST API's views).

What a part wants another part to do is a typed intent (``intents.py``): handed to
the switchboard, built here before the parts and connected to them once built, or
returned to the switchboard by a method it calls. ``Switchboard.route`` (``switchboard.py``) is
every route between the parts, in one ``match``, carried out at once (the order and
the loop iteration of a direct call); ``Apply`` is the policy's ``Actions``: wake
workers, refuse requests, run the copies or the switch the lanes allow.

And here: life (start, drain, close; the composition kept in ``[pool] state_file``)
and the API's entry points. Time is ``clock`` (``time.monotonic`` unless given; the
parity test gives the event loop's own, simulated, clock, and then deadlines are
exact).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from vertumnus.config import ConfigError, resolve_model
from vertumnus.config.model import attention_mix
from vertumnus.perfmodel import Profile, ProfileError
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.geometry import LatticeError
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_config import PolicyError
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.transition import Transition
from vertumnus.runtime import readiness, views
from vertumnus.runtime.background import Background
from vertumnus.runtime.health import Health
from vertumnus.runtime.kv import host_memory
from vertumnus.runtime.kv.copies import CopyRuns, KVCopier
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.kv.host_memory import HostTierMemory
from vertumnus.runtime.kv.segments import served_block_bytes
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.periodic import Periodic
from vertumnus.runtime.prompt_logprobs import check_top_k
from vertumnus.runtime.rank_link import RankLink
from vertumnus.runtime.ranks import ChildRanks, CurrentRanks, Ranks
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.request_path import PrefillResult, RequestPath, Unavailable
from vertumnus.runtime.reshaping import Reshaping
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.runtime.state import Shared
from vertumnus.runtime.switchboard import Parts, Switchboard, save_composition
from vertumnus.runtime.worker_loops import WorkerLoops

log = structlog.get_logger("vertumnus")

__all__ = ["Coordinator"]


class Coordinator:
    ACTIVE = (WorkerState.ACTIVE,)

    def __init__(
        self,
        cfg: ServeConfig,
        ranks: Ranks | None = None,
        clock: Callable[[], float] = time.monotonic,
        offload_decisions: bool = True,
    ) -> None:
        """``ranks``: the ranks, when they are not this process's children (a
        ``RayRanks`` on a Ray cluster, already gathered; an in-process fake in
        tests); None: a ``ChildRanks``. ``offload_decisions``: the controller's
        replays run on their own thread (off: inline, as the simulator runs them)."""
        self.cfg = cfg
        self.clock = clock
        self._given_ranks = ranks
        self.model_cfg, self.model_dir = resolve_model(cfg.model)
        if (uncached := self.model_cfg.block_cache_problem(cfg.engine.block_size)) is not None:
            # Served, with every prefill computing its whole prompt.
            log.warning("prefix_cache_off", reason=uncached)
        try:
            self.profile = Profile.load(cfg.profile)
            if (served := attention_mix(self.model_cfg)) != self.profile.attention:
                # A profile of another model: its E counts other attention work.
                log.warning("profile_attention_differs", model=served.groups,
                            profile=self.profile.attention.groups)  # fmt: skip
            # The host tier's block is the served model's, at the ranks' KV dtype.
            spec = cfg.pool.spec(cfg.engine, served_block_bytes(self.model_cfg, cfg.engine))
            self.policy = PoolPolicy.build(self.profile, spec, cfg.policy)
        except (PolicyError, LatticeError, ProfileError) as exc:
            raise ConfigError(f"{exc}") from exc
        tiers = self.policy.tiers
        # The host tier's bytes (``runtime/kv/host_memory.py``), made at ``start``;
        # ranks that hold no KV (the parity test's fakes) run the tier's policy with no
        # bytes to move.
        holds_kv = ranks is None or ranks.holds_kv
        if holds_kv:
            host_memory.check(tiers, cfg.policy.cache.host_tier_bytes, cfg.engine, cfg.ranks, ranks)
        self.tier = HostTierMemory(tiers, cfg.ranks) if tiers.enabled and holds_kv else None
        period_s = cfg.policy.controller.period_s
        self.metrics = Metrics(
            cfg.timeline_s, cfg.timeline_samples, clock(), period_s, model_name=cfg.model
        )
        self.health = Health()
        self.background = Background(self.metrics)
        self.switchboard = Switchboard(cfg, self.policy, self.health, self.background)
        self.shared = shared = Shared(
            cfg=cfg,
            model=self.model_cfg,
            profile=self.profile,
            policy=self.policy,
            metrics=self.metrics,
            health=self.health,
            clock=clock,
            ranks=CurrentRanks(),
            background=self.background,
            switchboard=self.switchboard,
        )
        # The parts, each after those it uses (the module docstring's order).
        self.copier = KVCopier(shared)
        self.copies = CopyRuns(shared, self.copier)
        self.handoffs = Handoffs(shared)
        self.link = RankLink(shared, self.copier, self.handoffs.reads)
        self.recovery = Recovery(shared, self.link, self.handoffs)
        self.requests = RequestPath(shared, self.link, self.handoffs, self.recovery, self.tier)
        self.loops = WorkerLoops(shared, self.requests)
        self.reshaping = Reshaping(shared, self.link, self.handoffs, self.recovery)
        self.periodic = Periodic(shared, self.copies, self.reshaping, offload_decisions)
        self.switchboard.connect(
            Parts(self.link, self.recovery, self.requests, self.loops, self.reshaping, self.copies)
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started_s = time.monotonic()

    # -- what tests and the views read ---------------------------------------------------

    @property
    def lattice(self) -> Lattice:
        return self.policy.lattice

    @property
    def cache(self) -> PrefixCacheManager:
        return self.policy.cache

    @property
    def scheduler(self) -> Scheduler:
        return self.policy.scheduler

    @property
    def indexes(self) -> dict[int, WorkerCacheIndex]:
        return self.policy.indexes

    @property
    def ranks(self) -> Ranks | None:
        """The ranks once started (None before the start and after the close)."""
        return self.shared.ranks.now

    @property
    def ready(self) -> bool:
        """The ranks started and admission is open."""
        return self.health.ready

    @property
    def rank_error(self) -> str | None:
        """Why the pool cannot serve, when it cannot."""
        return self.health.failure

    @property
    def open_requests(self) -> int:
        """Accepted and not yet answered."""
        return len(self.requests.open)

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        if self.cfg.start is not None:  # [pool] composition = "auto" (config/start.py)
            for why in self.cfg.start.warnings:
                log.warning("start_source_skipped", reason=why)
            log.info("start_chosen", **self.cfg.start.to_json())
        ranks: Ranks = self._given_ranks or ChildRanks(
            self.model_cfg, self.model_dir, self.cfg.engine, self.cfg.ranks, self.cfg.degrees
        )
        try:
            if self.tier is not None:  # (ranks of this host: ``host_memory.check``)
                stores = ranks.local_stores
                assert stores is not None
                self.tier.open(stores)  # before the ranks start: their stores must fit too
            await loop.run_in_executor(None, ranks.start)
        except BaseException:
            if self.tier is not None:
                self.tier.close()
                ranks.close()  # (the stores' segments, made for the tier before the start)
            raise
        self.shared.ranks.now = ranks
        ranks.report_to(loop, self.switchboard)  # (a host back: ``HostsBack``; Ray's reach)
        for w in self.policy.lattice.workers.values():
            self.loops.add_worker(w.worker_id)
        # The event loop itself watches the ranks' answer pipes and their process
        # sentinels: no thread between a rank's answer and the request it finishes.
        self.link.attach(loop, ranks)
        self.link.watch(range(self.cfg.ranks))
        self.periodic.start(loop)
        self.health.ready = True
        answers = ranks.ready.values()  # each rank's RankReady
        for answer in answers:
            if answer.eager_because is not None:
                log.warning("rank_layers_eager", rank=answer.rank, because=answer.eager_because)
        layers = ",".join(sorted({answer.layers for answer in answers})) or None
        attention = ",".join(sorted({answer.attention for answer in answers})) or None
        name, count = self.composition_name(), self.cfg.ranks
        timed = ranks.attention_ms or None  # how "auto" chose, if it did
        log.info(
            "ready",
            ranks=count,
            composition=name,
            layers=layers,
            attention=attention,
            attention_ms=timed,
        )

    def stop_admission(self) -> None:
        """New requests get a 503 (``Unavailable``); what was accepted goes on (a
        worker lost meanwhile is not restarted)."""
        self.health.ready = False
        self.health.draining = True
        self.health.failure = self.health.failure or "the server is shutting down"

    async def drain(self, grace_s: float) -> int:
        """Wait until every accepted request is answered, or ``grace_s`` passes;
        returns how many were still open."""
        deadline = time.monotonic() + grace_s
        while self.requests.open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(self.requests.open)

    async def close(self) -> None:
        """Stop admission, fail what still waits (a clear 503), stop the ranks."""
        self.health.stop()
        self.periodic.close()
        self.loops.cancel_all()
        self.requests.fail_all(Unavailable("the server is shutting down"))
        self.handoffs.close()
        self.reshaping.close()
        save_composition(self.cfg, self.lattice)
        self.link.unwatch()
        if self.tier is not None:
            self.tier.close()  # (its views of the ranks' stores go before the stores)
        ranks = self.shared.ranks.now
        if ranks is not None:
            assert self._loop is not None
            await self.recovery.settle()  # (a restart's thread first: never two at once)
            await self._loop.run_in_executor(None, ranks.close)
            self.shared.ranks.now = None

    def unready_reason(self) -> str | None:
        """Why the pool cannot dispatch a request now (None: it can): ``/ready``."""
        if self.health.cluster_error is not None and self.ready:
            return self.health.cluster_error
        return readiness.unready_reason(
            self.ready,
            self.rank_error,
            self.health.stopping,
            self.policy,
            self.reshaping.overdue,
            self.cfg.reshape_timeout_s,
        )

    # -- the prefix-cache manager: scans and copies (``runtime/kv/copies.py``) ----------

    async def scan_now(self) -> dict[str, Any]:
        """One scan now, waiting for its copies: what it did."""
        return await self.copies.scan_now()

    async def run_copy(self, plan: CopyPlan) -> int:
        """Run a copy plan made outside a scan; the blocks installed."""
        return await self.copies.run_plan(plan)

    # -- the API's entry points -------------------------------------------------------

    async def prefill(
        self, tokens: Sequence[int], handoff: bool = False, prompt_logprobs: int | None = None
    ) -> PrefillResult:
        """``handoff``: keep the KV for a decode server; ``prompt_logprobs`` = k (0 to
        the vocabulary, else ValueError): the result's ``prompt_logprobs``, computed
        without the prefix cache (``runtime/prompt_logprobs.py``)."""
        check_top_k(prompt_logprobs, self.model_cfg.vocab_size)
        if prompt_logprobs is not None and self.model_cfg.dsv4 is not None:
            raise ValueError(
                "prompt logprobs (echo with logprobs) are not built for DeepSeek-V4 yet"
            )
        return await self.requests.prefill(tokens, handoff, prompt_logprobs)

    def begin_reshape(self, op: Reshape) -> asyncio.Future[Transition]:
        return self.reshaping.begin(op)

    def reshape_for(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        return self.reshaping.choose(op_name, workers)

    def composition_name(self) -> str:
        return self.policy.composition_name(self.ACTIVE)

    def workers_view(self) -> list[dict[str, Any]]:
        return views.workers_view(self.policy, self.ranks, self.clock(), self.recovery.restarting)

    def composition_view(self) -> dict[str, Any]:
        return views.composition_view(
            self.policy, self.composition_name(), self.cfg, self.periodic.decisions
        )

    def cache_view(self) -> dict[str, Any]:
        return views.cache_view(self.policy, self.metrics, self.tier)

    def tier_view(self) -> dict[str, Any] | None:
        """The host tier's use (None: no tier): ``/metrics``, ``/v1/cache``, the
        dashboard."""
        return views.tier_view(self.policy, self.tier)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_s

    @property
    def decision_s(self) -> list[float]:
        """Wall time of the recent decisions' replays."""
        return self.periodic.decision_s

    def window_phase_s(self) -> float | None:
        """How far into its current window the controller is."""
        return self.periodic.phase_s()
