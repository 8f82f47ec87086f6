"""The halo plan of a sliding-window layer: every rank ends up with every position its
queries see within the window, the rows of the blocks it stores and (CP rank 0) the
exported rows; what one rank sends another is what that one expects; and a rank
receives no more than its two chunks' windows and its own blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vertumnus.engine.halo import plan_halo
from vertumnus.engine.partition import ZigzagPartition

BS = 4


@settings(max_examples=300, deadline=None)
@given(
    c=st.integers(1, 4),
    r=st.integers(1, 60),
    prefix_blocks=st.integers(0, 6),
    window=st.integers(1, 40),
    export=st.booleans(),
)
def test_every_rank_gets_what_it_needs_and_no_more(
    c: int, r: int, prefix_blocks: int, window: int, export: bool
) -> None:
    part, p = ZigzagPartition(r, c), prefix_blocks * BS
    new_depths = range(prefix_blocks, (p + r) // BS)
    writes = tuple(tuple(d for d in new_depths if d % c == q) for q in range(c))
    exported = (0, r) if export else None
    plans = [plan_halo(part, q, p, BS, window, writes, exported) for q in range(c)]
    for q, plan in enumerate(plans):
        have = set(plan.own_positions) | {x for peer in plan.recv_positions for x in peer}
        for a, b in part.ranges(q):
            for i in range(a, min(b, r)):  # each real query's window
                assert set(range(max(0, p + i - window + 1), p + i + 1)) <= have
        for d in writes[q]:
            assert set(range(d * BS, (d + 1) * BS)) <= have
        if exported and q == 0:
            assert set(range(p, p + r)) <= have
        # Peer q' sends q exactly the rows q expects from it.
        for sender, other in enumerate(plans):
            assert len(other.send_rows[q]) == len(plan.recv_positions[sender])
        halo = 2 * max(0, window - 1) + len(writes[q]) * BS + (r if exported and q == 0 else 0)
        assert plan.received <= halo
