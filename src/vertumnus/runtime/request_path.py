"""The request path: from an HTTP handler's token ids to the answer, exactly once.

    prefill(tokens) -> the policy places it (or it waits, or is refused) -> the
    worker's task starts the head of its queue (the policy leases its cache; the
    host tier's copies it asks for are done at once, ``start``) ->
    PrefillCommand to every rank -> every PrefillDone (``RankLink``) -> the policy
    commits the new blocks -> the answer -> the next request of that worker

Owns the open requests (their futures, attempts) and the step that takes a started
prefill to its answer (``run_one``; each worker's task, ``worker_loops.py``, runs
them, and ``contain`` answers a step that failed with a bug). A prefill that fails
because its worker failed is placed again, up to ``MAX_ATTEMPTS``; a client that
gives up (time-out) leaves the policy's queues at once. Every request is answered
exactly once: with its result, or with an error that says why (``Unavailable``,
``Overloaded``, or ``InternalError`` for a bug, which is logged with its traceback
and counted while the worker goes on serving). What the policy returns is handed
to the switchboard (``Apply``). It does not choose workers (the policy) nor restart them
(``recovery``, a collaborator: a failed worker is taken down there).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from vertumnus.engine.logprobs import PromptLogprobs
from vertumnus.engine.messages import PrefillCommand, PrefillDone
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_results import Finished, Started
from vertumnus.runtime.intents import Apply
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.kv.host_memory import HostTierMemory
from vertumnus.runtime.kv.leases import Lease, export_range
from vertumnus.runtime.prefill import prefill_command
from vertumnus.runtime.prompt_logprobs import placement_ids, prompt_answer
from vertumnus.runtime.rank_link import RankLink, WorkerLost
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")

MAX_ATTEMPTS = 3  # prefills of one request before a failure is the client's answer


class Overloaded(RuntimeError):
    """Admission refused: too much work queued (retry later)."""


class Unavailable(RuntimeError):
    """No worker can serve the request now (retry later)."""


class InternalError(RuntimeError):
    """A bug stopped the request (logged with its traceback): the answer is a 500."""


@dataclass
class PrefillResult:
    request_id: int
    first_token: int
    cached_tokens: int
    computed_tokens: int
    worker: int
    cp_degree: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    rank_compute_s: float  # the slowest rank's compute; the rest of ttft_s is overhead
    logits: Any = None  # fp32 [V] at the last position (not sent over the API)
    handoff: Lease | None = None  # the KV kept for a decode server to pull
    prompt_logprobs: PromptLogprobs | None = None  # asked for: the whole prompt's


@dataclass
class _Request:
    request_id: int
    tokens: list[int]
    arrival_s: float
    future: asyncio.Future[PrefillResult]
    attempts: int = 0
    handoff: bool = False  # keep the prompt's KV under a lease for a decode server
    prompt_logprobs: int | None = None  # k: its prompt's log-probabilities, top k


class RequestPath:
    def __init__(
        self,
        shared: Shared,
        link: RankLink,
        handoffs: Handoffs,
        recovery: Recovery,
        tier: HostTierMemory | None,
    ) -> None:
        """``link``: the answers a prefill waits for; ``handoffs``: the leases of its
        KV; ``recovery``: takes a failed worker down; ``tier``: the host tier's bytes
        (None: no tier). The profile's ``E_C(R, P)`` gives an answer's SLO."""
        self.cfg, self.policy, self.metrics = shared.cfg, shared.policy, shared.metrics
        self.health, self.ranks, self.clock = shared.health, shared.ranks, shared.clock
        self.switchboard, self.predict = shared.switchboard, shared.profile.predict
        self.link, self.handoffs, self.recovery = link, handoffs, recovery
        self.tier = tier
        self.caches_prefixes = shared.model.caches_prefixes(shared.cfg.engine.block_size)
        # DeepSeek-V4: a hand-off exports the whole prompt's state (``export_range``), a
        # command carries its prefix's token ids (``engine/dsv4/blocks.py``)
        self.dsv4 = shared.model.dsv4 is not None
        self._unmoved: dict[int, Exception] = {}  # request -> its tier copies' failure
        self.open: dict[int, _Request] = {}
        self._ids = itertools.count(1)

    async def prefill(
        self, tokens: Sequence[int], handoff: bool = False, prompt_logprobs: int | None = None
    ) -> PrefillResult:
        """``handoff``: keep the prompt's KV under a lease (``runtime/kv/handoffs.py``);
        ``prompt_logprobs`` = k: the answer carries the prompt's log-probabilities
        and top k, computed without the prefix cache (``prompt_logprobs.py``)."""
        if not self.health.ready:
            raise Unavailable(self.health.failure or "the server is not ready")
        if len(self.open) >= self.cfg.max_queued:
            raise Overloaded(f"{len(self.open)} requests in the pool")
        if handoff and self.handoffs.full():
            raise Overloaded(f"{len(self.handoffs.leases)} KV hand-offs wait to be pulled")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        now = self.clock()
        future = loop.create_future()
        req = _Request(
            rid, list(tokens), now, future, handoff=handoff, prompt_logprobs=prompt_logprobs
        )
        self.open[rid] = req
        block = self.cfg.engine.block_size
        ids = placement_ids(tokens, block, prompt_logprobs, self.caches_prefixes)
        timeout_s = self.cfg.request_timeout_s
        result: PrefillResult | None = None
        try:
            self.metrics.timeline.arrived(now)
            self.switchboard.route(
                Apply(self.policy.arrive(PlacementRequest(rid, len(tokens), ids), now))
            )
            result = await asyncio.wait_for(asyncio.shield(req.future), timeout_s)
            return result
        except TimeoutError:
            limit = f"[server] request_timeout_s = {timeout_s:g} s"
            raise Unavailable(f"request {rid} was not answered within {limit}") from None
        finally:
            self.open.pop(rid, None)
            self.policy.abandon(rid, self.clock())  # (nothing if answered)
            self._unanswered(req, result)

    def _unanswered(self, req: _Request, returned: PrefillResult | None) -> None:
        """The caller stopped waiting for ``req`` (answered, timed out or cancelled):
        an answer it will not get never comes (the future is cancelled, so a prefill
        still running ends its lease at once, ``_answer``), and one that came as it
        left gives back the KV kept for it."""
        future = req.future
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:  # (retrieved: no bug)
            kept = future.result().handoff
            if kept is not None and returned is None:  # (cancelled as it was answered)
                self.handoffs.end(kept.handle, "released")

    def refuse(self, request_id: int, error: Exception) -> None:
        req = self.open.get(request_id)
        if req is not None and not req.future.done():
            req.future.set_exception(error)

    def fail_all(self, error: Exception) -> None:
        for req in self.open.values():
            if not req.future.done():
                req.future.set_exception(error)

    # -- one worker's step (``worker_loops.py`` runs them) ---------------------------

    def start(self, worker_id: int, now: float) -> Started | None:
        """The worker's next prefill (``PoolPolicy.start``), its host-tier copies done
        now, in the step that decided them: the blocks its lease evicted written to the
        tier (before any other start may reuse their tier slots, or this prefill their
        rank slots), then the blocks it loads back, before its command leaves. A
        failed copy (a bug) fails the prefill in ``run_one``."""
        started = self.policy.start(worker_id, now)
        if started is None or self.tier is None or not (started.demotions or started.loads):
            return started
        try:
            seconds = self.tier.move(started.first_device, started.demotions, started.loads)
        except Exception as exc:
            self._unmoved[started.request_id] = exc
        else:
            self.metrics.tier_moved(len(started.demotions), len(started.loads), seconds)
        return started

    def contain(self, worker_id: int, started: Started | None, exc: Exception) -> None:
        """An unexpected exception in a worker's step: logged with its traceback and
        counted; a prefill the policy still runs for the request ends as failed; the
        request is answered once, with an error that names the bug."""
        rid = None if started is None else started.request_id
        fields = {"worker": worker_id, "request_id": rid}
        self.metrics.bug("worker_step", "worker_step_failed", exc, **fields)
        if started is None:
            return
        running = self.policy.running(worker_id)
        if running is not None and running.request_id == rid:
            self.switchboard.route(
                Apply(self.policy.finish(worker_id, self.clock(), ok=False).actions)
            )
        self.policy.drop(started.request_id)
        req = self.open.get(started.request_id)
        if req is not None and not req.future.done():
            req.future.set_exception(InternalError(f"request {rid} failed: {exc!r}"))

    async def run_one(self, started: Started) -> None:
        policy, ranks = self.policy, self.ranks.now
        assert ranks is not None
        rid, worker_id = started.request_id, started.worker_id
        unmoved = self._unmoved.pop(rid, None)
        if unmoved is not None:  # (``contain`` answers it)
            raise InternalError(f"request {rid}: its host-tier copies failed: {unmoved!r}")
        start = self.clock()
        req = self.open.get(rid)
        if req is None:  # (answered already: nothing to compute)
            self.switchboard.route(Apply(policy.finish(worker_id, start, ok=False).actions))
            policy.drop(rid)
            return
        req.attempts += 1
        devices = tuple(started.devices)
        block = self.cfg.engine.block_size
        export = None
        if req.handoff:
            export = export_range(started.allocation, len(req.tokens), block, self.dsv4)
        k = req.prompt_logprobs
        cmd = prefill_command(
            started.allocation, req.tokens, block, rid, devices, "last", export, k, self.dsv4
        )
        answers = self.link.expect_prefill(rid, devices)
        dead = sorted(set(devices) & self.recovery.dead_ranks)
        if dead:  # (failed since the start: no answer will come)
            answers.set_exception(WorkerLost(f"worker {worker_id} failed: ranks {dead} are down"))
        else:
            for r in devices:
                ranks.send(r, cmd)
        failure: Exception | None = None
        done: dict[int, PrefillDone] = {}
        try:
            done = await asyncio.wait_for(asyncio.shield(answers), self.cfg.step_timeout_s)
        except TimeoutError:
            # A hung rank: take the worker down (its ranks are killed and restarted)
            # and place the request again.
            self.recovery.rank_down(
                devices[0],
                f"no answer within step_timeout_s = {self.cfg.step_timeout_s} s",
                whole_worker=True,
            )
            failure = WorkerLost(f"worker {worker_id} timed out")
        except (WorkerLost, RanksError) as exc:
            failure = exc
        finally:
            self.link.forget_prefill(rid)
        end = self.clock()
        if failure is not None:
            self._failed(started, req, failure, end)
            return
        compute_s = max(d.compute_s for d in done.values())
        # The hold (a hand-off's KV pinned) is taken in the step that commits the
        # blocks: a reshape of this worker now waits for the lease to end.
        hold = req.handoff and not req.future.done()
        finished = policy.finish(worker_id, end, compute_s=compute_s, hold=hold)
        try:
            if not finished.ok:  # its KV went with a reset of the worker
                self._failed(started, req, WorkerLost(f"worker {worker_id} was reset"), end, False)
                return
            self._answer(started, req, cmd, done, finished, start, end)
        finally:
            self.switchboard.route(Apply(finished.actions))

    def _answer(
        self,
        started: Started,
        req: _Request,
        cmd: PrefillCommand,
        done: dict[int, PrefillDone],
        finished: Finished,
        start: float,
        end: float,
    ) -> None:
        """The prefill's answer (with its lease, for a hand-off), once; an answer that
        cannot be made (no lease opens) gives its hold back and the request an error."""
        rid, worker_id, ranks = req.request_id, started.worker_id, tuple(started.devices)
        logits = done[ranks[0]].logits
        lease = None
        try:
            assert logits is not None, "CP rank 0 answered no logits"
            prompt = prompt_answer(req.prompt_logprobs, cmd, done[ranks[0]])
            if finished.hold is not None:
                rows = done[ranks[0]].exported
                lease = self.handoffs.open(finished.hold, ranks[0], len(req.tokens), rows)
        except Exception as exc:
            if finished.hold is not None:
                self.switchboard.route(Apply(self.policy.release_hold(finished.hold, end)))
            raise InternalError(f"request {rid}: its answer could not be made: {exc!r}") from exc
        compute_s = max(d.compute_s for d in done.values())
        result = PrefillResult(
            request_id=rid,
            first_token=int(logits[-1].argmax()),
            cached_tokens=cmd.prefix_len,
            computed_tokens=int(cmd.token_ids.numel()),
            worker=worker_id,
            cp_degree=len(ranks),
            queue_s=start - req.arrival_s,
            prefill_s=end - start,
            ttft_s=end - req.arrival_s,
            rank_compute_s=compute_s,
            logits=logits[-1],
            handoff=lease,
            prompt_logprobs=prompt,
        )
        self.metrics.request(result)
        tau_s = self.cfg.slo.tau_s(len(req.tokens), self.predict, self.cfg.degrees)
        self.metrics.timeline.finished(
            end, result.ttft_s, tau_s, len(req.tokens), result.cached_tokens
        )
        log.info(
            "prefill",
            request_id=rid,
            worker=worker_id,
            cp_degree=len(ranks),
            input_tokens=len(req.tokens),
            cached_tokens=result.cached_tokens,
            queue_s=round(result.queue_s, 6),
            prefill_s=round(result.prefill_s, 6),
            ttft_s=round(result.ttft_s, 6),
        )
        if not req.future.done():
            req.future.set_result(result)
        elif lease is not None:  # (nobody waits for it any more)
            self.handoffs.end(lease.handle, "released")

    def _failed(
        self, started: Started, req: _Request, error: Exception, now: float, finish: bool = True
    ) -> None:
        """The prefill failed: placed again while attempts remain and its worker was
        lost, else answered with the error. ``finish``: the policy has not been told
        yet."""
        policy = self.policy
        worker_id = started.worker_id
        if isinstance(error, RanksError):  # the worker's group is out of step now
            self.recovery.rank_down(
                started.first_device, f"prefill failed: {error}", whole_worker=True
            )
        if finish:
            self.switchboard.route(Apply(policy.finish(worker_id, now, ok=False).actions))
        lost = isinstance(error, WorkerLost | RanksError) or self.recovery.recovering(worker_id)
        wanted = req.request_id in self.open and not req.future.done()  # (not timed out)
        if lost and req.attempts < MAX_ATTEMPTS and wanted:
            log.warning("replaced", request_id=req.request_id, worker=worker_id, error=str(error))
            self.switchboard.route(Apply(policy.replace(req.request_id, now)))
            return
        policy.drop(req.request_id)
        if wanted:
            why = str(error) if isinstance(error, WorkerLost) else f"worker {worker_id}: {error}"
            req.future.set_exception(Unavailable(why))
