"""The audit of every move (``policy/control/audit.py``): what it waits for, what it
measures, how its error becomes the next decisions' pessimism, and the holders of
the arrivals translated into each world's workers."""

from __future__ import annotations

import pytest

from vertumnus.policy.control.audit import MoveAudits, OpenAudit, band_of
from vertumnus.policy.control.candidates import Candidate
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay_types import ReplayWorker
from vertumnus.policy.lattice import LatticeWorker, Reshape, WorkerState

SPLIT = Reshape("split", (7,), 2, (0, 2))


def candidate(kind: str = "split") -> Candidate:
    ops = (SPLIT,) if kind == "split" else ()
    workers = (ReplayWorker(100, 2, 0.0), ReplayWorker(101, 2, 0.0))
    made = ((100, 101),) if ops else ()
    return Candidate(kind, 4 if ops else 0, ops, {2: 2}, workers, workers, {7: (100, 101)},
                     {}, (), made)  # fmt: skip


def opened(audits: MoveAudits, now: float = 10.0, span_s: float = 5.0) -> None:
    audits.open(3, now, span_s, candidate(), candidate("hold"), "loaded", 0.2, 0.25, 0.1,
                {7: range(0, 4)})  # fmt: skip


def sample(rid: int, t: float, holders: tuple[tuple[int, int], ...] = ()) -> ArrivalSample:
    return ArrivalSample(rid, t, 100, holders)


def children() -> dict[int, LatticeWorker]:
    return {
        11: LatticeWorker(11, 2, 0, WorkerState.ACTIVE, 1),
        12: LatticeWorker(12, 2, 2, WorkerState.ACTIVE, 1),
        5: LatticeWorker(5, 4, 4, WorkerState.ACTIVE, 0),
    }


def test_bands() -> None:
    assert [band_of(b, 0.9) for b in (0.1, 0.59, 0.6, 0.89, 0.9, 1.5)] == [
        "light", "light", "loaded", "loaded", "saturated", "saturated",
    ]  # fmt: skip


def test_the_prior_until_audits_come_then_their_errors_either_way() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    assert audits.pessimism("split", "loaded") == pytest.approx(0.05, rel=1e-12)
    for x, expected in ((0.3, (0.1 + 0.3) / 3), (-0.2, (0.1 + 0.3 + 0.2) / 4)):
        opened(audits)
        audits.arrived(sample(1, 11.0))
        audits.completed(1, 0.2 * (1 + x))  # measured against a replay of 0.2 s
        ((audit, _, _),) = audits.due(16.0, children())
        entry = audits.record(audit, 0.2, 0.25, bias=0.0)
        assert entry["error"] == pytest.approx(x, rel=1e-9)
        assert audits.pessimism("split", "loaded") == pytest.approx(expected, rel=1e-9)
    # other kinds and bands keep the prior
    assert audits.pessimism("merge", "loaded") == audits.pessimism("split", "light") == 0.05


def test_the_models_bias_on_undisturbed_periods_is_taken_out() -> None:
    audits = MoveAudits(prior=0.0, prior_weight=1.0)
    opened(audits)
    audits.arrived(sample(1, 11.0))
    audits.completed(1, 0.3)
    ((audit, _, _),) = audits.due(16.0, children())
    # 50 % slower than the move's replay, but the model is 50 % slow everywhere
    entry = audits.record(audit, 0.2, 0.25, bias=0.5)
    assert entry["error"] == pytest.approx(0.0, abs=1e-12)
    assert entry["vs_hold"] == pytest.approx(0.3 / (0.25 * 1.5) - 1, rel=1e-12)
    assert entry["predicted_vs_hold"] == pytest.approx(0.2 / 0.25 - 1, rel=1e-12)
    assert audits.pessimism("split", "loaded") == pytest.approx(0.0, abs=1e-12)


def test_an_audit_waits_for_its_span_and_its_answers() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits, now=10.0, span_s=5.0)
    audits.arrived(sample(1, 9.0))  # before the move: not its
    audits.arrived(sample(2, 12.0))
    audits.arrived(sample(3, 15.0))  # after the span: not its
    assert audits.due(14.0, children()) == []  # the span is open
    assert audits.due(20.0, children()) == []  # request 2 is not answered
    audits.completed(2, 0.5)
    ((audit, moved, _),) = audits.due(20.0, children())
    assert [s.request_id for s in moved] == [2] and audit.ttft_s == {2: 0.5}
    assert audits.due(20.0, children()) == []  # closed once


def test_an_audit_most_of_whose_requests_never_end_is_dropped() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits, now=10.0, span_s=5.0)
    for rid in range(10):
        audits.arrived(sample(rid, 11.0))
    for rid in range(8):
        audits.completed(rid, 0.1)
    assert audits.due(74.0, children()) == []  # waiting for the last two
    assert audits.due(76.0, children()) == []  # a minute on, 80 %: dropped
    assert audits.due(200.0, children()) == []


def test_a_move_inside_anothers_span_marks_it_overlapped_and_it_teaches_nothing() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits, now=10.0, span_s=5.0)
    opened(audits, now=12.0, span_s=5.0)
    audits.arrived(sample(1, 12.5))
    audits.completed(1, 1.0)
    first, second = (a for a, _, _ in audits.due(30.0, children()))
    assert first.overlapped and not second.overlapped
    assert audits.record(first, 0.2, 0.25, 0.0)["overlapped"] is True
    assert audits.pessimism("split", "loaded") == pytest.approx(0.05, rel=1e-12)
    audits.record(second, 0.2, 0.25, 0.0)
    assert audits.pessimism("split", "loaded") == pytest.approx((0.1 + 4.0) / 3, rel=1e-12)


def test_holders_after_the_move_are_translated_into_each_world() -> None:
    # The split made workers 11 (devices 0-1) and 12 (2-3) of source 7 (0-3); the
    # move's replay calls them 100 and 101, holding's replay has 7 itself.
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits)
    audits.arrived(sample(1, 11.0, ((12, 64), (5, 32))))
    audits.completed(1, 0.1)
    ((_, moved, held),) = audits.due(16.0, children())
    assert moved[0].holders == ((101, 64), (5, 32))
    assert held[0].holders == ((7, 64), (5, 32))


def test_a_revised_sample_replaces_the_one_that_arrived() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits)
    audits.arrived(sample(1, 11.0))
    audits.arrived(sample(2, 12.0))
    audits.revised(sample(1, 11.0, ((12, 64),)))  # its start found its prefix at 12
    audits.revised(sample(3, 13.0, ((12, 64),)))  # not in the span: ignored
    audits.completed(1, 0.1)
    audits.completed(2, 0.1)
    ((_, moved, held),) = audits.due(16.0, children())
    assert [s.request_id for s in moved] == [1, 2]  # in arrival order
    assert moved[0].holders == ((101, 64),) and held[0].holders == ((7, 64),)
    assert moved[1].holders == ()


def test_open_audit_fields() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    opened(audits)
    audits.arrived(sample(1, 11.0))
    audits.completed(1, 0.1)
    ((audit, _, _),) = audits.due(16.0, children())
    assert isinstance(audit, OpenAudit)
    assert (audit.window, audit.start_s, audit.end_s, audit.kind, audit.level) == (
        3, 10.0, 15.0, "split", 4,
    )  # fmt: skip
    assert (audit.predicted_s, audit.predicted_hold_s, audit.predicted_gain) == (0.2, 0.25, 0.1)


def test_a_span_is_watched_until_it_ends() -> None:
    audits = MoveAudits(prior=0.05, prior_weight=2.0)
    assert not audits.watching(0.0)
    opened(audits, now=10.0, span_s=5.0)
    assert audits.watching(10.0) and audits.watching(14.9) and not audits.watching(15.0)
