"""The asyncio coordinator: the pool's policy stack around live rank processes.

The policy is ``PoolPolicy`` (``policy/pool_policy.py``), built by the same factory
and driven the same way as in the simulator; a parity test runs one trace through
both. The coordinator adds asyncio, the ranks and the views, in parts of one job
each, which it builds and wires: each part is given the collaborators it uses, and
``apply`` where it acts on what the policy returns; none is given the coordinator.

    request_path.py   an HTTP request's life: placement, its prefill, its answer
    worker_loops.py   one task per worker, running its queue
    rank_link.py      the rank pipes: every answer a rank owes and who waits for it
    reshaping.py      a committed switch carried out on the ranks (SwitchEpoch, acks)
    recovery.py       a failed rank: its worker out, restarted, back
    periodic.py       the one timer: controller windows, cache scans, expiry
    background.py     the background tasks, none lost in silence
    kv/copies.py      the cache manager's scans and copies; a copy job's blocks moved
                      rank to rank (KVTransfer, KVWritten)
    kv/handoffs.py    KV kept for a decode server under leases, and its pull (KVRead)
    kv/host_tier.py   the host tier's bytes: blocks the ranks evict, and loaded back
    health.py         whether the pool serves (ready, its failure, stopping)
    readiness.py      whether the pool can dispatch now, and if not, why (``/ready``)
    views.py          workers, composition and cache for the REST API

and here: life (start, drain, close; the composition kept in ``[pool] state_file``),
``apply`` (doing what the policy returns: wake workers, refuse requests, run the
copies or the switch the lanes allow), and the API's entry points. Time is ``clock``
(``time.monotonic`` unless given; the parity test gives the event loop's own,
simulated, clock, and then deadlines are exact).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from vertumnus.config import ConfigError, resolve_model
from vertumnus.config.start import write_state
from vertumnus.perfmodel import Profile, ProfileError, attention_mix
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.lattice import Lattice, LatticeError, Reshape, WorkerState
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_config import PolicyError
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.pool_results import Actions
from vertumnus.policy.transition import Transition
from vertumnus.runtime import readiness, views
from vertumnus.runtime.background import Background
from vertumnus.runtime.health import Health
from vertumnus.runtime.kv import host_tier
from vertumnus.runtime.kv.copies import CopyRuns, KVCopier
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.kv.host_tier import HostTierStore
from vertumnus.runtime.kv.segments import served_block_bytes
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.periodic import Periodic
from vertumnus.runtime.prompt_logprobs import check_top_k
from vertumnus.runtime.rank_link import RankLink
from vertumnus.runtime.ranks import ChildRanks, Ranks
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.request_path import Overloaded, PrefillResult, RequestPath, Unavailable
from vertumnus.runtime.reshaping import Reshaping
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.runtime.worker_loops import WorkerLoops

log = structlog.get_logger("vertumnus")

__all__ = ["Coordinator", "Overloaded", "PrefillResult", "Unavailable"]


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
        ``ClusterRanks`` of node agents, already gathered; an in-process fake in
        tests); None: a ``ChildRanks``. ``offload_decisions``: the controller's
        replays run on their own thread (off: inline, as the simulator runs them)."""
        self.cfg = cfg
        self.clock = clock
        self._given_ranks = ranks
        self.model_cfg, self.model_dir = resolve_model(cfg.model)
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
        # The host tier's bytes (``runtime/kv/host_tier.py``), made at ``start``;
        # ranks that hold no KV (``holds_kv`` False: the parity test's fakes) run the
        # tier's policy with no bytes to move.
        holds_kv = getattr(ranks, "holds_kv", True)
        if holds_kv:
            host_tier.check(tiers, cfg.policy.cache.host_tier_bytes, cfg.engine, cfg.ranks, ranks)
        self.tier = HostTierStore(tiers, cfg.ranks) if tiers.enabled and holds_kv else None
        period_s = cfg.policy.controller.period_s
        self.metrics = Metrics(
            cfg.timeline_s, cfg.timeline_samples, clock(), period_s, model_name=cfg.model
        )
        self.spawn = Background(self.metrics).spawn
        self.ranks: Ranks | None = None
        self.copier = KVCopier(
            lambda: self.ranks, cfg.engine.rank_timeout_s, lambda r: self.recovery.copy_hung(r)
        )
        self.copies = CopyRuns(self.policy, self.copier, self.metrics, clock, self.apply)
        self.handoffs = Handoffs(
            cfg, self.model_cfg, self.policy, self.metrics, clock, self.apply, lambda: self.ranks
        )
        self.link = RankLink(
            self.copier,
            lambda rank: self.recovery.rank_exited(rank),
            lambda error: self.recovery.pool_failed(error),
            lambda rank, error: self.recovery.rank_down(rank, error),
            self.handoffs.reads,
        )
        self.health = Health()
        self.recovery = Recovery(
            cfg=cfg,
            policy=self.policy,
            metrics=self.metrics,
            link=self.link,
            handoffs=self.handoffs,
            health=self.health,
            ranks=lambda: self.ranks,
            clock=clock,
            apply=self.apply,
            spawn=self.spawn,
            rejoined=lambda worker_id: self.loops.wake(worker_id),
        )
        self.requests = RequestPath(
            cfg=cfg,
            policy=self.policy,
            metrics=self.metrics,
            link=self.link,
            handoffs=self.handoffs,
            recovery=self.recovery,
            health=self.health,
            tier=self.tier,
            predict=self.profile.predict,
            ranks=lambda: self.ranks,
            clock=clock,
            apply=self.apply,
        )
        self.loops = WorkerLoops(
            self.policy, clock, self.requests.run_one, self.requests.contain, self.requests.start
        )
        self.reshaping = Reshaping(
            cfg=cfg,
            policy=self.policy,
            metrics=self.metrics,
            link=self.link,
            handoffs=self.handoffs,
            recovery=self.recovery,
            health=self.health,
            ranks=lambda: self.ranks,
            clock=clock,
            apply=self.apply,
            save=self.save_composition,
        )
        self.periodic = Periodic(
            cfg=cfg,
            policy=self.policy,
            metrics=self.metrics,
            copies=self.copies,
            health=self.health,
            clock=clock,
            apply=self.apply,
            spawn=self.spawn,
            begun=self.reshaping.begun,
            offload=offload_decisions,
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
            if self.tier is not None:  # (ranks of this host: ``host_tier.check``)
                assert isinstance(ranks, ChildRanks)
                self.tier.open(ranks)  # before the ranks start: their stores must fit too
            await loop.run_in_executor(None, ranks.start)
        except BaseException:
            if self.tier is not None:
                self.tier.close()
                ranks.close()  # (the stores' segments, made for the tier before the start)
            raise
        self.ranks = ranks

        def rejoin(back: list[int]) -> None:  # a host's agent came back (another thread)
            loop.call_soon_threadsafe(self.recovery.hosts_back, back)

        ranks.on_rejoin = rejoin
        for w in self.policy.lattice.workers.values():
            self.loops.add_worker(w.worker_id)
        # The event loop itself watches the ranks' answer pipes and their process
        # sentinels: no thread between a rank's answer and the request it finishes.
        self.link.attach(loop, ranks)
        self.link.watch(range(self.cfg.ranks))
        self.periodic.start(loop)
        self.health.ready = True
        answers = getattr(ranks, "ready", {}).values()  # each rank's RankReady
        for answer in answers:
            if answer.eager_because is not None:
                log.warning("rank_layers_eager", rank=answer.rank, because=answer.eager_because)
        layers = ",".join(sorted({answer.layers for answer in answers})) or None
        attention = ",".join(sorted({answer.attention for answer in answers})) or None
        name, count = self.composition_name(), self.cfg.ranks
        timed = getattr(ranks, "attention_ms", None) or None  # how "auto" chose, if it did
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
        self.save_composition()
        self.link.unwatch()
        if self.tier is not None:
            self.tier.close()  # (its views of the ranks' stores go before the stores)
        if self.ranks is not None:
            assert self._loop is not None
            await self.recovery.settle()  # (a restart's thread first: never two at once)
            await self._loop.run_in_executor(None, self.ranks.close)
            self.ranks = None

    def save_composition(self) -> None:
        """The composition the pool has, into ``[pool] state_file`` (if one is
        configured) for the next start: on every completed reshape and at shutdown."""
        path = self.cfg.pool.start.state_file
        if path is not None:
            try:
                write_state(path, self.lattice.config, self.lattice.layout())
            except OSError as exc:
                log.warning("state_file_not_written", path=path, error=str(exc))

    def unready_reason(self) -> str | None:
        """Why the pool cannot dispatch a request now (None: it can): ``/ready``."""
        return readiness.unready_reason(
            self.ready,
            self.rank_error,
            self.health.stopping,
            self.policy,
            self.reshaping.overdue,
            self.cfg.reshape_timeout_s,
        )

    # -- doing what the policy returns ----------------------------------------------------

    def apply(self, actions: Actions) -> None:
        if self.health.stopping:
            return  # (what the stack asks for now would only outlive the ranks)
        for placement in actions.placed:
            self.loops.wake(placement.worker_id)
        for worker_id in actions.woken:
            self.loops.wake(worker_id)
        for request_id in actions.refused:
            self.requests.refuse(request_id, Unavailable("no worker can take the request now"))
        self.copies.ended(actions.copies_ended)
        for transition in actions.activated:
            self.reshaping.activated(transition)
        if actions.switch is not None:
            transition = actions.switch.transition
            for s in transition.op.sources:
                self.loops.remove_worker(s)
            for w in transition.new_workers:
                self.loops.add_worker(w)
            self.spawn(self.reshaping.run_switch(actions.switch))
        for job in actions.copies:
            self.spawn(self.copies.run(job))

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
        return await self.requests.prefill(tokens, handoff, prompt_logprobs)

    def begin_reshape(self, op: Reshape) -> asyncio.Future[Transition]:
        return self.reshaping.begin(op)

    def reshape_for(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        return self.reshaping.choose(op_name, workers)

    def composition_name(self) -> str:
        return self.policy.composition_name(self.ACTIVE)

    def workers_view(self) -> list[dict[str, Any]]:
        return views.workers_view(self.policy, self.ranks, self.clock(), self.recovery.recovering)

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
