"""The engine's block accounting on its own (pure Python): chained hashes, prefix matching, ref counts, LRU.

No torch and no model here, so every rule of the prefix cache is checked by exact block ids.
"""

from __future__ import annotations

import pytest
from wcache.engine.block_manager import ROOT_HASH, BlockManager, KVCacheFullError, chain_hashes

BS = 4


def filled(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and register one block per full block of `tokens`, as a finished request would; still held."""
    ids = []
    for block_hash in chain_hashes(tokens, manager.block_size):
        block_id = manager.allocate()
        assert manager.register(block_id, block_hash)
        ids.append(block_id)
    return ids


# -- chained hashes -----------------------------------------------------------------------------------


def test_chain_hashes_cover_full_blocks_only() -> None:
    assert chain_hashes([], BS) == []
    assert chain_hashes([1, 2, 3], BS) == []
    assert len(chain_hashes(list(range(4)), BS)) == 1
    assert len(chain_hashes(list(range(11)), BS)) == 2  # the partial third block has no hash
    assert all(len(h) == 16 and h != ROOT_HASH for h in chain_hashes(list(range(12)), BS))


def test_equal_prefixes_give_equal_hashes() -> None:
    a = list(range(100, 120))
    b = [*a[:12], 7, 7, 7, 7, 7, 7, 7, 7]
    ha, hb = chain_hashes(a, BS), chain_hashes(b, BS)
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))
    # Deterministic across calls, and a longer prompt extends the same chain.
    assert chain_hashes(a, BS) == ha
    assert chain_hashes([*a, 1, 2, 3, 4], BS)[:5] == ha


@pytest.mark.parametrize("k", [0, 2, 4])
def test_a_change_in_block_k_changes_hashes_from_k_on(k: int) -> None:
    tokens = list(range(20))  # five blocks
    changed = list(tokens)
    changed[k * BS + 1] += 1000
    before, after = chain_hashes(tokens, BS), chain_hashes(changed, BS)
    assert before[:k] == after[:k]
    assert all(x != y for x, y in zip(before[k:], after[k:], strict=True))


def test_equal_block_contents_at_different_depths_hash_differently() -> None:
    # The chain makes a block's hash depend on everything before it, not just its own tokens.
    hashes = chain_hashes([5, 5, 5, 5] * 3, BS)
    assert len(set(hashes)) == 3


def test_block_hash_depends_on_block_size() -> None:
    tokens = list(range(16))
    assert chain_hashes(tokens, 4)[1] != chain_hashes(tokens, 8)[0]


# -- matching -----------------------------------------------------------------------------------------


def test_match_returns_the_longest_cached_prefix() -> None:
    m = BlockManager(8, BS)
    tokens = list(range(16))
    ids = filled(m, tokens)
    hashes = chain_hashes(tokens, BS)
    assert m.match(hashes) == ids
    assert m.match(hashes[:2]) == ids[:2]
    assert m.match([]) == []
    longer = chain_hashes([*tokens, 1, 2, 3, 4], BS)
    assert m.match(longer) == ids  # the uncached fifth block ends the match


def test_match_stops_at_the_first_miss() -> None:
    m = BlockManager(8, BS)
    tokens = list(range(16))
    hashes = chain_hashes(tokens, BS)
    ids = [m.allocate() for _ in hashes]
    for i in (0, 2, 3):  # block 1 never registered
        m.register(ids[i], hashes[i])
    assert m.match(hashes) == [ids[0]]
    assert m.match(hashes[1:]) == []  # a later block alone is not a prefix


# -- reference counts ---------------------------------------------------------------------------------


def test_allocate_acquire_release_count_references() -> None:
    m = BlockManager(4, BS)
    assert m.num_free == 4
    (a,) = filled(m, [1, 2, 3, 4])
    assert m.blocks[a].ref_count == 1 and m.num_free == 3
    m.acquire([a])
    assert m.blocks[a].ref_count == 2
    m.release([a])
    assert m.blocks[a].ref_count == 1 and m.num_free == 3
    m.release([a])
    assert m.blocks[a].ref_count == 0 and m.num_free == 4
    assert m.is_cached(a)  # free but still findable
    m.acquire([a])  # adopting a free cached block takes it off the free list
    assert m.blocks[a].ref_count == 1 and m.num_free == 3 and m.is_cached(a)
    m.release([a])
    with pytest.raises(AssertionError, match="released more often"):
        m.release([a])


def test_shared_block_stays_in_use_until_every_holder_releases() -> None:
    m = BlockManager(2, BS)
    (a,) = filled(m, [1, 2, 3, 4])
    m.acquire([a])  # a second request adopts it
    m.release([a])  # the first request finishes
    b = m.allocate()
    assert b != a
    with pytest.raises(KVCacheFullError):
        m.allocate()  # `a` is still held by the second request
    m.release([a, b])
    assert m.num_free == 2


# -- LRU eviction -------------------------------------------------------------------------------------


def test_never_used_blocks_go_before_cached_ones() -> None:
    m = BlockManager(4, BS)
    ids = filled(m, list(range(8)))
    m.release(ids)
    fresh = [m.allocate(), m.allocate()]
    assert set(fresh).isdisjoint(ids)
    assert all(m.is_cached(i) for i in ids)


def test_least_recently_released_block_is_evicted_first() -> None:
    m = BlockManager(4, BS)
    ids = filled(m, list(range(16)))
    hashes = chain_hashes(list(range(16)), BS)
    order = [ids[2], ids[0], ids[3], ids[1]]
    for block_id in order:
        m.release([block_id])
    evicted = []
    for expected in order:
        block_id = m.allocate()
        evicted.append(block_id)
        assert block_id == expected
        assert not m.is_cached(block_id)
        assert m.blocks[block_id].hash is None and m.blocks[block_id].ref_count == 1
    assert m.num_cached == 0
    assert m.match(hashes) == []


def test_eviction_drops_the_hash_so_the_chain_breaks_there() -> None:
    m = BlockManager(3, BS)
    tokens = list(range(12))
    ids = filled(m, tokens)
    m.release([ids[1]])
    m.release([ids[0], ids[2]])
    assert m.allocate() == ids[1]  # released first, evicted first
    assert m.match(chain_hashes(tokens, BS)) == [ids[0]]


def test_reacquired_block_moves_to_the_recent_end() -> None:
    m = BlockManager(2, BS)
    a, b = filled(m, list(range(8)))
    m.release([a, b])  # a is older
    m.acquire([a])
    m.release([a])  # a is now the most recent
    assert m.allocate() == b
    assert m.allocate() == a


def test_acquired_blocks_are_never_evicted() -> None:
    m = BlockManager(3, BS)
    tokens = list(range(12))
    ids = filled(m, tokens)
    m.release(ids)
    m.acquire([ids[0]])  # adopted by a running request
    taken = {m.allocate(), m.allocate()}
    assert taken == {ids[1], ids[2]}
    with pytest.raises(KVCacheFullError):
        m.allocate()
    assert m.is_cached(ids[0]) and m.blocks[ids[0]].ref_count == 1
    assert m.match(chain_hashes(tokens, BS)) == [ids[0]]


# -- register -----------------------------------------------------------------------------------------


def test_register_duplicate_keeps_the_first_block() -> None:
    m = BlockManager(4, BS)
    (first,) = filled(m, [9, 9, 9, 9])
    (h,) = chain_hashes([9, 9, 9, 9], BS)
    second = m.allocate()
    assert m.register(second, h) is False
    assert m.register(first, h) is True  # re-registering the cached block itself is fine
    assert m.match([h]) == [first]
    assert m.blocks[second].hash is None and not m.is_cached(second)
    assert m.num_cached == 1
    # Recycling the duplicate must not unregister the original.
    m.release([second])
    m.release([first])
    for _ in range(3):
        m.allocate()  # the two never-used blocks, then `second`
    assert m.match([h]) == [first]


def test_register_after_eviction_makes_a_new_block_findable() -> None:
    m = BlockManager(1, BS)
    (a,) = filled(m, [1, 2, 3, 4])
    (h,) = chain_hashes([1, 2, 3, 4], BS)
    m.release([a])
    b = m.allocate()  # evicts `a` (the same physical block)
    assert m.match([h]) == []
    assert m.register(b, h)
    assert m.match([h]) == [b]


# -- full ---------------------------------------------------------------------------------------------


def test_full_cache_error_says_what_to_do() -> None:
    m = BlockManager(2, BS)
    m.allocate()
    m.allocate()
    with pytest.raises(KVCacheFullError) as info:
        m.allocate()
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "no free block" in message
    assert "num_blocks" in message
    assert m.num_free == 0


def test_zero_blocks_is_full_at_once() -> None:
    m = BlockManager(0, BS)
    assert m.num_free == 0 and m.match(chain_hashes([1, 2, 3, 4], BS)) == []
    with pytest.raises(KVCacheFullError):
        m.allocate()


# -- weight switches ----------------------------------------------------------------------------------


def test_blocks_of_weights_no_longer_served_are_reused_before_never_used_ones() -> None:
    # A training loop's engine switches versions every step: it must reuse what older versions filled, not fault
    # in its whole KV pool a never-used block at a time, and a switch back still finds what is left.
    manager = BlockManager(num_blocks=8, block_size=BS)
    manager.serve("a")
    first = [manager.allocate() for _ in range(2)]
    for block_id, block_hash in zip(first, chain_hashes(list(range(8)), BS), strict=True):
        assert manager.register(block_id, block_hash, "a")
    manager.release(first)
    assert manager.allocate() not in first  # the weights served now keep their cached blocks while fresh ones last
    manager.serve("b")
    reused = manager.allocate()
    assert reused == first[0]  # a's least recently released block, before any never-used one
    manager.serve("a")
    assert manager.match(chain_hashes(list(range(8)), BS)[1:], "a") == [first[1]]  # a's other block survived
    assert manager.num_free == 8 - 2
