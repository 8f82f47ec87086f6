"""The pool's hosts on a Ray cluster: the connection, the nodes chosen, and one
placement group per host.

Owns the coordinator's side of Ray below the ranks: connecting (``ray.init``) after
checking that the cluster admits only holders of its token (``auth.py``); choosing
``[cluster] hosts`` live nodes with the same number of rank slots (a GPU each on GPU
hosts, ``cpus_per_rank`` CPUs each on CPU hosts); reserving each host's slots once,
as one placement group pinned to its node (one bundle per rank): a split or a merge
only switches process groups between ranks that keep their bundles, and a rank that
fails is recreated inside its own; and watching
(a thread, every ``poll_s``) for a node that leaves, a placement group whose
bundles fall back to pending, and a node that can take a vacant host's place. It
tells its owner (``HostEvents``: ``RayRanks``) which host was lost and which is
back, and says whether Ray answers (``trouble``). It knows nothing of ranks' actors
or answers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from vertumnus.runtime.cluster.auth import check_token_auth
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.serve_tables import ClusterConfig

log = structlog.get_logger("vertumnus")

NODE_LABEL = "ray.io/node-id"  # every Ray node carries its id as this label


class HostEvents(Protocol):
    """What the hosts report, on their watch thread."""

    def host_lost(self, host: int) -> None: ...
    def host_back(self, host: int) -> None: ...
    def reach_changed(self, error: str | None) -> None: ...


@dataclass
class Host:
    """Host ``index`` of the pool: the node it runs on and its placement group (None
    while vacant: the node left and none has taken its place yet)."""

    index: int
    node_id: str | None = None
    address: str = ""
    group: Any = None  # ray.util.placement_group.PlacementGroup

    @property
    def name(self) -> str:
        if self.node_id is None:
            return f"host{self.index} (vacant)"
        return f"{self.address}/{self.node_id[:8]}"


class RayHosts:
    def __init__(self, cluster: ClusterConfig, device: str) -> None:
        """``device``: ``[engine] device`` (auto: GPU slots where the nodes have GPUs)."""
        self.cluster, self._device = cluster, device
        self.gpu = device == "cuda"
        self.per_host = 0
        self.hosts: list[Host] = []
        self.store_host = "127.0.0.1"  # this process's address, as the nodes reach it
        self.trouble: str | None = None  # why Ray does not answer, while it does not
        self._events: HostEvents | None = None
        self._lock = threading.Lock()  # the hosts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self._checking_since: float | None = None  # a check under way began then

    # -- start -------------------------------------------------------------------------

    def connect(self) -> None:
        """Join the Ray cluster as a driver, refusing one without token authentication
        unless ``private_network``."""
        import ray

        if not self.cluster.private_network:
            check_token_auth(self.cluster.address)
        ray.init(
            address=self.cluster.address,
            namespace=self.cluster.namespace,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
        self._connected = True
        self.store_host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        if not self.cluster.private_network:
            check_token_auth(ray.get_runtime_context().gcs_address, probe=True)

    def gather(self, per_host: int | None, events: HostEvents) -> tuple[int, int]:
        """Wait for ``[cluster] hosts`` nodes (up to ``join_timeout_s``), reserve each
        one's rank slots and start watching; returns (ranks, ranks per host)."""
        self._events = events
        deadline = time.monotonic() + self.cluster.join_timeout_s
        said = -1
        while True:
            nodes = self._candidates(per_host)
            if self._device == "auto" and not self.gpu and any(n[2]["GPU"] for n in nodes):
                self.gpu = True
                continue
            if len(nodes) >= self.cluster.hosts:
                break
            if len(nodes) != said:
                said = len(nodes)
                log.info("waiting_for_ray_nodes", hosts=self.cluster.hosts, eligible=said)
            if time.monotonic() > deadline:
                raise RanksError(
                    f"{said} of the {self.cluster.hosts} Ray nodes [cluster] hosts asks for "
                    f"joined within join_timeout_s = {self.cluster.join_timeout_s:g} s "
                    f"(a node qualifies with {self._slot_words(per_host)})"
                )
            time.sleep(self.cluster.poll_s)
        chosen = nodes[: self.cluster.hosts]
        slots = {self._slots(res) for _, _, res in chosen}
        if per_host is None and len(slots) > 1:
            raise RanksError(
                f"the Ray nodes offer different numbers of rank slots {sorted(slots)}: "
                "set [pool] devices_per_host (each host runs that many ranks)"
            )
        self.per_host = per_host or slots.pop()
        self.hosts = [Host(k) for k in range(self.cluster.hosts)]
        for host, (node_id, address, _) in zip(self.hosts, chosen, strict=True):
            self._reserve(host, node_id, address, self.cluster.join_timeout_s)
        self._thread = threading.Thread(target=self._watch, name="vertumnus-ray", daemon=True)
        self._thread.start()
        return self.per_host * len(self.hosts), self.per_host

    def bundle(self) -> dict[str, float]:
        """One rank's reservation."""
        return {"GPU": 1.0} if self.gpu else {"CPU": self.cluster.cpus_per_rank}

    def _slots(self, resources: dict[str, float]) -> int:
        if self.gpu:
            return int(resources.get("GPU", 0))
        return int(resources.get("CPU", 0) // self.cluster.cpus_per_rank)

    def _slot_words(self, per_host: int | None) -> str:
        n = per_host or 1
        return f"{n} GPU(s)" if self.gpu else f"{n * self.cluster.cpus_per_rank:g} CPU(s)"

    def _candidates(self, per_host: int | None) -> list[tuple[str, str, dict[str, float]]]:
        """Live nodes with room for a host, not hosting one: (id, address, resources),
        in a fixed order (address, then id)."""
        import ray

        used = {h.node_id for h in self.hosts}
        out = []
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            res = {"GPU": 0.0, "CPU": 0.0, **node.get("Resources", {})}
            fits = self._slots(res) >= (per_host or 1)
            if node.get("Alive") and node["NodeID"] not in used and fits:
                out.append((node["NodeID"], node["NodeManagerAddress"], res))
        return sorted(out, key=lambda n: (n[1], n[0]))

    def _reserve(self, host: Host, node_id: str, address: str, timeout_s: float) -> bool:
        """Reserve ``host``'s slots on ``node_id``: True once placed (False, and nothing
        kept, when Ray could not place them within ``timeout_s``)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        n = self.per_host
        group = placement_group(
            [self.bundle()] * n,
            strategy="STRICT_PACK",
            bundle_label_selector=[{NODE_LABEL: node_id}] * n,
        )
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            return False
        with self._lock:
            host.node_id, host.address, host.group = node_id, address, group
        log.info("ray_host_reserved", host=host.index, node=node_id, address=address, slots=n)
        return True

    # -- what the ranks ask --------------------------------------------------------------

    def host_of_rank(self, rank: int) -> Host:
        return self.hosts[rank // self.per_host]

    def check_placed(self, index: int) -> None:
        """Raise RanksError unless host ``index``'s slots are placed now (a node Ray has
        declared dead, before the watch saw it, leaves its group rescheduling: an
        actor created in it would wait there for a node that never comes)."""
        from ray.util.placement_group import placement_group_table

        host = self.hosts[index]
        group = host.group
        if group is None:
            raise RanksError(f"host {index} has no Ray node now")
        state = placement_group_table(group).get("state")
        if state != "CREATED":
            raise RanksError(f"host {index}'s placement group is {state}: its node is gone")

    def vacant(self, ranks: list[int]) -> list[int]:
        """The hosts of ``ranks`` that have no node now."""
        with self._lock:
            return sorted({h.index for r in ranks if (h := self.host_of_rank(r)).group is None})

    # -- the watch -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Check every ``poll_s``; a check that raises, or one still unanswered after
        ``reach_timeout_s`` (Ray's calls wait, rather than fail, while its GCS is
        gone), makes Ray unreachable until a check succeeds again."""
        alarm = threading.Thread(target=self._alarm, name="vertumnus-ray-alarm", daemon=True)
        alarm.start()
        while not self._stop.wait(self.cluster.poll_s):
            self._checking_since = time.monotonic()
            try:
                self._check()
            except Exception as exc:
                self._unreachable(f"{type(exc).__name__}: {exc}")
                continue
            finally:
                self._checking_since = None
            with self._lock:
                back, self.trouble = self.trouble is not None, None
            if back:
                log.info("ray_reachable")
                if self._events is not None:
                    self._events.reach_changed(None)
        alarm.join()

    def _alarm(self) -> None:
        while not self._stop.wait(self.cluster.poll_s):
            since = self._checking_since
            if since is not None and time.monotonic() - since > self.cluster.reach_timeout_s:
                self._unreachable(f"no answer in {time.monotonic() - since:.0f} s")

    def _unreachable(self, why: str) -> None:
        with self._lock:
            if self.trouble is not None:
                return
            self.trouble = f"the Ray cluster does not answer: {why}"
        log.error("ray_unreachable", error=why)
        if self._events is not None:
            self._events.reach_changed(self.trouble)

    def _check(self) -> None:
        import ray
        from ray.util.placement_group import placement_group_table, remove_placement_group

        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        for host in self.hosts:
            if self._stop.is_set():
                return
            if host.group is None:
                free = self._candidates(self.per_host)
                if free and self._reserve(host, free[0][0], free[0][1], 30.0):
                    assert self._events is not None
                    self._events.host_back(host.index)
                continue
            state = placement_group_table(host.group).get("state")
            if host.node_id in alive and state == "CREATED":
                continue
            log.error("ray_host_lost", host=host.index, node=host.node_id, group_state=state)
            group = host.group
            with self._lock:
                host.group, host.node_id = None, None
            assert self._events is not None
            self._events.host_lost(host.index)
            remove_placement_group(group)  # (its actors die with it)

    # -- end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop watching, give every placement group back and leave the cluster;
        idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        if not self._connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for host in self.hosts:
            if host.group is not None:
                try:
                    remove_placement_group(host.group)
                except Exception as exc:  # (Ray gone: its groups are gone with it)
                    log.warning("ray_group_not_removed", host=host.index, error=repr(exc))
                host.group = None
        ray.shutdown()
        self._connected = False
