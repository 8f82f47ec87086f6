"""What the cache manager's copies did: the audit of every copied block.

Each scan is recorded with what it started (copies, the blocks they bring, their
predicted benefit; reclamations and their predicted loss; the candidates that did
not pay). Every block a copy installs is then followed at its worker until it
leaves:

    used     a prefill there reused it (a hit) before it was evicted
    wasted   it was evicted (or reclaimed) before any hit
    live     still held, not yet reused (unresolved)

The hits a scan's copies served are the requests that reused at least one of their
blocks. The waste fraction is ``wasted / (used + wasted)``, per kind of copy (the
scan's inter and intra copies, pulls, fetches and adoptions after a reshape) and in
all. Pure Python; the policy stack feeds it (``PoolPolicy.start``: reuses; the KV
ledger: installs; the manager: evictions and scans).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from vertumnus.policy.cache.plans import CopyPlan, ScanResult


@dataclass
class ScanRecord:
    scan: int
    time_s: float
    copies: int  # started
    copy_blocks: int  # the blocks they were planned to bring
    predicted_benefit_s: float  # their summed benefit, per statistics window
    reclaims: int
    predicted_loss_s: float
    unpaid: dict[str, int]  # candidates that would not pay for themselves, per list
    installed_blocks: int = 0
    hits: int = 0  # requests that reused at least one block these copies installed
    used_blocks: int = 0
    wasted_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class KindTotals:
    copies: int = 0  # copies that installed at least one block
    installed_blocks: int = 0
    hits: int = 0
    used_blocks: int = 0
    wasted_blocks: int = 0


@dataclass
class _Live:
    kind: str
    record: ScanRecord | None
    hits: int = 0


@dataclass
class CopyAudit:
    max_scans: int = 10_000
    scans: deque[ScanRecord] = field(default_factory=deque)
    kinds: dict[str, KindTotals] = field(default_factory=dict)
    _records: dict[int, ScanRecord] = field(default_factory=dict)  # plan -> its scan's
    _live: dict[tuple[int, int], _Live] = field(default_factory=dict)  # (worker, block)
    _count: int = 0
    reclaimed_total: int = 0  # replicas reclaimed by every scan so far

    def scanned(self, now: float, result: ScanResult, reclaimed: int) -> ScanRecord:
        self._count += 1
        self.reclaimed_total += reclaimed
        record = ScanRecord(
            self._count,
            now,
            len(result.copies),
            sum(len(c.moves) for c in result.copies),
            sum(c.benefit_s for c in result.copies),
            reclaimed,
            sum(r.loss_s for r in result.reclaims),
            dict(result.unpaid),
        )
        for plan in result.copies:
            self._records[plan.plan_id] = record
        self.scans.append(record)
        if len(self.scans) > self.max_scans:
            self.scans.popleft()
        return record

    def finished(self, plan_id: int) -> None:
        """The plan ended (its installs, if any, are recorded)."""
        self._records.pop(plan_id, None)

    def installed(self, plan: CopyPlan, block_ids: Iterable[int]) -> None:
        blocks = list(block_ids)
        if not blocks:
            return
        record = self._records.get(plan.plan_id)
        totals = self.kinds.setdefault(plan.kind, KindTotals())
        totals.copies += 1
        totals.installed_blocks += len(blocks)
        if record is not None:
            record.installed_blocks += len(blocks)
        for bid in blocks:
            self._live[(plan.dest_worker, bid)] = _Live(plan.kind, record)

    def reused(self, worker_id: int, block_ids: Iterable[int]) -> None:
        """A prefill on ``worker_id`` reuses ``block_ids``."""
        live = self._live
        if not live:
            return
        kinds: set[str] = set()  # a request is one hit per kind and per scan it used
        records: dict[int, ScanRecord] = {}
        for bid in block_ids:
            entry = live.get((worker_id, bid))
            if entry is None:
                continue
            if not entry.hits:
                self.kinds[entry.kind].used_blocks += 1
                if entry.record is not None:
                    entry.record.used_blocks += 1
            entry.hits += 1
            kinds.add(entry.kind)
            if entry.record is not None:
                records[entry.record.scan] = entry.record
        for kind in kinds:
            self.kinds[kind].hits += 1
        for record in records.values():
            record.hits += 1

    def evicted(self, worker_id: int, block_id: int) -> None:
        entry = self._live.pop((worker_id, block_id), None)
        if entry is not None and not entry.hits:
            self.kinds[entry.kind].wasted_blocks += 1
            if entry.record is not None:
                entry.record.wasted_blocks += 1

    def forget_worker(self, worker_id: int) -> None:
        """The worker left: its copied blocks are neither used nor wasted."""
        for key in [k for k in self._live if k[0] == worker_id]:
            del self._live[key]

    def hit_share(self) -> dict[str, float]:
        """Per kind, the share of its resolved copied blocks that were reused before
        their eviction, (used + 1) / (used + wasted + 2): 1/2 before any evidence."""
        return {
            kind: (t.used_blocks + 1) / (t.used_blocks + t.wasted_blocks + 2)
            for kind, t in self.kinds.items()
        }

    def summary(self) -> dict[str, Any]:
        """Totals per kind and in all, with the waste fractions (None: nothing
        resolved yet) and the blocks still held unused."""
        unresolved: dict[str, int] = {}
        for entry in self._live.values():
            if not entry.hits:
                unresolved[entry.kind] = unresolved.get(entry.kind, 0) + 1
        out: dict[str, Any] = {"scans": self._count}
        total = KindTotals()
        for kind, t in sorted(self.kinds.items()):
            out[kind] = {**asdict(t), "live_unused_blocks": unresolved.get(kind, 0)}
            out[kind]["waste_fraction"] = _fraction(t)
            for name in ("copies", "installed_blocks", "hits", "used_blocks", "wasted_blocks"):
                setattr(total, name, getattr(total, name) + getattr(t, name))
        out["all"] = {
            **asdict(total),
            "live_unused_blocks": sum(unresolved.values()),
            "waste_fraction": _fraction(total),
        }
        return out


def _fraction(t: KindTotals) -> float | None:
    resolved = t.used_blocks + t.wasted_blocks
    return t.wasted_blocks / resolved if resolved else None
