"""Block manager: ref counts, prefix caching, lazy eviction, and the reserve-region protocol."""
import pytest

from memory.block_manager import BlockManager
from replicas.sampling_params import SamplingParams
from replicas.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(), 0, 0.0)


def run_prefill(bm, s):
    bm.match_prefix(s)
    n = s.num_tokens - s.num_computed_tokens
    assert bm.can_allocate(s, n)
    bm.allocate(s, n)
    before = s.num_computed_tokens
    s.num_computed_tokens += n
    bm.commit_full_blocks(s, before)


def test_prefix_hit_shares_blocks_and_never_serves_last_token():
    bm = BlockManager(16, 0, 4)
    a = seq(range(12))                      # exactly 3 full blocks
    run_prefill(bm, a)
    b = seq(range(12), "b")
    cached = bm.match_prefix(b)
    assert cached == 8                      # the block holding the last prompt token is recomputed
    assert b.block_table == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)
    assert bm.hits == 8 and bm.queries == 24


def test_hash_hit_verified_against_stored_tokens():
    bm = BlockManager(8, 0, 4)
    a = seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, a)
    blk = bm.blocks[a.block_table[0]]
    blk.token_ids = (9, 9, 9, 9)            # simulate a hash collision with different content
    b = seq([1, 2, 3, 4, 5, 6], "b")
    assert bm.match_prefix(b) == 0


def test_free_keeps_cache_until_evicted_lru():
    bm = BlockManager(4, 0, 2)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)                      # 3 blocks, 2 full (hashed)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    b = seq([1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4          # served from freed-but-cached blocks
    bm.free(b)
    c = seq(range(100, 107))                # needs all 4 blocks: evicts the cached ones
    run_prefill(bm, c)
    assert len(bm.hash_to_block) == 3 and bm.num_free_blocks == 0
    assert seq([1, 2, 3, 4, 5]).num_tokens and bm.match_prefix(seq([1, 2, 3, 4, 5])) == 0


def test_reserve_blocks_only_while_lent():
    bm = BlockManager(2, 2, 4)
    a = seq(range(8))
    run_prefill(bm, a)
    assert all(not bm.is_reserve(b) for b in a.block_table)
    b = seq(range(10, 14), "b")
    bm.match_prefix(b)
    assert not bm.can_allocate(b, 4)        # base is full, reserve not lent
    bm.lend_reserve()
    assert bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    assert bm.is_reserve(b.block_table[0])
    with pytest.raises(AssertionError):
        bm.reclaim_reserve()                # live block in the reserve


def test_migration_moves_live_reserve_blocks_and_cache_entries():
    bm = BlockManager(4, 4, 2)
    bm.lend_reserve()
    fill = seq(range(100, 108), "fill")     # takes all 4 base blocks
    run_prefill(bm, fill)
    a = seq([1, 2, 3, 4, 5])                # lands in the reserve
    run_prefill(bm, a)
    assert all(bm.is_reserve(b) for b in a.block_table)
    bm.free(fill)                           # base has room again
    plan = bm.plan_migration()
    assert set(plan) == set(a.block_table) and all(not bm.is_reserve(d) for d in plan.values())
    bm.apply_migration(plan, [a])
    assert all(not bm.is_reserve(b) for b in a.block_table)
    bm.reclaim_reserve()
    assert not bm.reserve_lent
    b = seq([1, 2, 3, 4, 5], "b")
    assert bm.match_prefix(b) == 4 and b.block_table == a.block_table[:2]


def test_reclaim_evicts_cached_free_reserve_blocks():
    bm = BlockManager(1, 3, 2)
    bm.lend_reserve()
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    assert any(bm.is_reserve(b) for b in bm.hash_to_block.values())
    bm.reclaim_reserve()
    assert not any(bm.is_reserve(b) for b in bm.hash_to_block.values())
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "b")) <= 2


def test_unmatch_prefix_gives_back_the_hits_and_uncounts_the_lookup():
    bm = BlockManager(16, 0, 4)
    a = seq(range(12))
    run_prefill(bm, a)
    counts = (bm.queries, bm.hits)
    b = seq(range(12), "b")
    assert bm.match_prefix(b) == 8                # the waiting head is looked up ...
    bm.unmatch_prefix(b)                          # ... but does not fit this step
    assert (bm.queries, bm.hits) == counts
    assert not b.block_table and b.num_computed_tokens == 0
    assert all(bm.blocks[i].ref_count == 1 for i in a.block_table)
