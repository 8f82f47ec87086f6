"""The global prefix trie: holders from reports, matching, pruning, invariants."""

from __future__ import annotations

import pytest

from vertumnus.blocks import ROOT_BLOCK_ID
from vertumnus.policy.cache.nodes import TrieError
from vertumnus.policy.cache.trie import PrefixTrie


def make_trie() -> PrefixTrie:
    """Workers 10, 11 of degree 1 on devices 0, 1 and worker 20 of degree 2 on 2-3."""
    trie = PrefixTrie([1, 2], block_tokens=16)
    trie.add_worker(10, 1, 0)
    trie.add_worker(11, 1, 1)
    trie.add_worker(20, 2, 2)
    return trie


def test_reports_build_holders_and_match_follows_them() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1, 2, 3])
    trie.insert_chain(20, ROOT_BLOCK_ID, [1, 2])
    trie.insert_chain(20, 2, [4])  # a branch beside 3
    trie.check()
    assert [n.block_id for n in trie.match([1, 2, 3, 9], max_blocks=4)] == [1, 2, 3]
    assert [n.block_id for n in trie.match([1, 2, 3], max_blocks=2)] == [1, 2]
    assert trie.match([7, 1], max_blocks=2) == []
    path, depth_of = trie.match_with_reuse([1, 2, 4], 3)
    assert depth_of == {10: 2, 20: 3}
    assert path == trie.match([1, 2, 4], 3)
    assert trie.held_depth(path, trie.worker(10).slot) == 2
    assert [n.block_id for n in trie.reused_path(path, 10)] == [1, 2]
    assert trie.reused_path(path, 11) == []
    assert trie.prefix_tokens(path[-1]) == 48
    node1 = trie.nodes[1]
    assert (trie.replica_count(node1, 1), trie.replica_count(node1, 2)) == (1, 1)
    assert node1.num_children == 1 and trie.nodes[2].num_children == 2
    assert [n.depth for n in path] == [0, 1, 2]
    assert trie.worker(20).device_of(2) == 2 and trie.worker(20).device_of(1) == 3


def test_replicated_set_tracks_two_holders_of_one_degree() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1])
    trie.insert_chain(20, ROOT_BLOCK_ID, [1])
    assert trie.replicated == set()  # one holder at each degree
    trie.insert_chain(11, ROOT_BLOCK_ID, [1])
    assert trie.replicated == {trie.nodes[1]}
    trie.evict(11, 1)
    assert trie.replicated == set()
    trie.check()


def test_eviction_prunes_nodes_nothing_keeps() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1, 2, 3])
    trie.add_access(trie.nodes[2], 0, 1.0)
    trie.evict(10, 3)
    trie.evict(10, 2)
    trie.evict(10, 1)
    # 3 had nothing left and went; 2 keeps its statistics, and so keeps its parent.
    assert set(trie.nodes) == {1, 2}
    trie.check()
    trie.decay(0.5, floor=0.6)  # 0.5 < 0.6: dropped, and the pair is pruned
    assert trie.nodes == {} and trie.touched == set()
    trie.check()


def test_reports_must_extend_a_held_prefix() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1, 2])
    with pytest.raises(TrieError, match="a prefix it does not hold"):
        trie.insert_chain(11, 2, [3])
    with pytest.raises(TrieError, match="unknown worker 99"):
        trie.insert_chain(99, ROOT_BLOCK_ID, [1])
    with pytest.raises(TrieError, match="under a different parent"):
        trie.insert_chain(11, ROOT_BLOCK_ID, [2])
    with pytest.raises(TrieError, match="degree 4 not in"):
        trie.add_worker(30, 4, 0)
    with pytest.raises(TrieError, match="already registered"):
        trie.add_worker(10, 1, 0)


def test_removing_a_worker_forgets_it_and_reuses_its_slot() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1, 2])
    trie.insert_chain(11, ROOT_BLOCK_ID, [1])
    trie.set_pending(trie.nodes[2], 11, retained_device=0)
    trie.remove_worker(11)
    assert trie.nodes[1].holders == 1 << trie.worker(10).slot
    assert trie.nodes[2].pending is None
    freed = trie.worker(10).slot
    trie.remove_worker(10)
    assert trie.nodes == {}
    assert trie.add_worker(12, 1, 1).slot == freed  # the last freed slot first
    assert len(trie.by_slot) == 2
    trie.check()


def test_check_catches_a_holder_without_its_parent() -> None:
    trie = make_trie()
    trie.insert_chain(10, ROOT_BLOCK_ID, [1, 2])
    trie.nodes[2].holders |= 1 << trie.worker(11).slot  # corrupt on purpose
    with pytest.raises(AssertionError, match="held without its parent"):
        trie.check()
