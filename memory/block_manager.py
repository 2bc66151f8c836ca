"""Ref-counted KV blocks with prefix caching by chained hashes of full blocks.

Block ids [0, num_base) are the base region, [num_base, num_base + num_reserve) the elastic
reserve. A reserve block is handed out only while the reserve is lent (`reserve_lent`), which the
elastic KV manager sets after mapping the memory and clears before unmapping it. The boundary moves at
run time when a lower step budget needs less of the reserve: `grant` makes the reserve's first blocks
base blocks for good, `begin_ungrant`/`end_ungrant` give the last granted ones back.

Freed blocks keep their hash and tokens and sit in an LRU free list; they are evicted lazily when
allocated for something else. A hash hit is verified against the stored tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

from memory.kv_host import BlockOwner


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: Optional[tuple[int, ...]] = None


def chain_hash(parent: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_base_blocks: int, num_reserve_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, reserve_mapped: bool = True):
        self.block_size = block_size
        self.num_base = num_base_blocks
        self.num_reserve = num_reserve_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_base_blocks + num_reserve_blocks)]
        self.free_base: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_base_blocks))
        self.free_reserve: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_base_blocks, num_base_blocks + num_reserve_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.reserve_lent = False
        self.reserve_mapped = reserve_mapped
        self.reserve_draining = False   # a reclaim is under way: the reserve hands out nothing
        self.queries = 0          # prompt tokens looked up in the prefix cache
        self.hits = 0             # of which served from cache

    # ---- capacity ---------------------------------------------------------------------------
    def is_reserve(self, block_id: int) -> bool:
        return block_id >= self.num_base

    @property
    def reserve_usable(self) -> bool:
        return self.reserve_lent and not self.reserve_draining

    @property
    def num_usable_blocks(self) -> int:
        return self.num_base + (self.num_reserve if self.reserve_usable else 0)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_base) + (len(self.free_reserve) if self.reserve_usable else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def reserve_blocks_in_use(self) -> list[int]:
        return [b.block_id for b in self.blocks[self.num_base:] if b.ref_count > 0]

    def blocks_needed(self, seq: BlockOwner, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: BlockOwner, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # ---- allocation -------------------------------------------------------------------------
    def _take_free(self) -> Block:
        # Base first: the reserve stays empty as long as possible, so reclaiming is cheap.
        if self.free_base:
            block_id, _ = self.free_base.popitem(last=False)
        else:
            assert self.reserve_usable and self.free_reserve, "no usable free block (caller must check)"
            assert self.reserve_mapped, "handing out a block of an unmapped reserve"
            block_id, _ = self.free_reserve.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self._evict(block)                       # lazy eviction of a cached, unreferenced block
        block.ref_count = 1
        return block

    def _evict(self, block: Block) -> bool:
        """Drop the block's prefix-cache entry, if it has one."""
        if block.hash is None:
            return False
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, None
        return True

    def _free_list(self, block_id: int) -> OrderedDict:
        return self.free_reserve if self.is_reserve(block_id) else self.free_base

    def allocate(self, seq: BlockOwner, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free().block_id)

    def cached_prefix(self, seq: BlockOwner) -> list[int]:
        """Blocks that would serve `seq`'s prompt from the cache (read-only). The last token is never
        served from cache (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        found: list[int] = []
        parent: Optional[int] = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:   # a miss, or a hash collision
                break
            found.append(block_id)
            parent = h
        return found

    def match_prefix(self, seq: BlockOwner) -> int:
        """On (re)admission: take cached full blocks for the longest matching prefix. Returns the number
        of cached tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        self.queries += seq.num_tokens
        for block_id in self.cached_prefix(seq):
            block = self.blocks[block_id]
            if self.is_reserve(block_id):
                assert self.reserve_usable and self.reserve_mapped, "prefix hit in a reserve that is not lent"
            if block.ref_count == 0:
                self._free_list(block_id).pop(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = cached
        self.hits += cached
        return cached

    def unmatch_prefix(self, seq: BlockOwner) -> None:
        """Undo `match_prefix` for an admission that did not fit: the blocks go back and the lookup is not
        counted (the head of the queue is looked up again at every step until it fits)."""
        if self.enable_prefix_caching:
            self.queries -= seq.num_tokens
            self.hits -= seq.num_computed_tokens
        self.free(seq)

    def commit_full_blocks(self, seq: BlockOwner, num_committed_before: int) -> None:
        """Register the hashes of blocks that became full (their tokens' KV is now written)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = num_committed_before // bs, seq.num_computed_tokens // bs
        if first == last:               # no block filled up (most decode steps)
            return
        parent = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.hash, block.token_ids = chain_hash(parent, tokens), tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
            parent = block.hash

    def free(self, seq: BlockOwner) -> None:
        self.truncate(seq, 0)
        seq.num_computed_tokens = 0

    def truncate(self, seq: BlockOwner, keep: int) -> None:
        """Give back the sequence's blocks past its first `keep` (all of them for `free`; the tree scratch
        a speculative round did not accept). Tail first, so that under LRU the shared prefix outlives the
        sequence's own suffix."""
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free_list(block_id)[block_id] = None

    # ---- elastic reserve protocol -----------------------------------------------------------
    def set_reserve_mapped(self, mapped: bool) -> None:
        assert mapped or not self.reserve_lent, "unmapping a reserve that is still lent"
        self.reserve_mapped = mapped

    def lend_reserve(self) -> None:
        assert not self.reserve_lent
        assert self.reserve_mapped, "lending a reserve whose memory is not mapped"
        assert all(b.ref_count == 0 and b.hash is None for b in self.blocks[self.num_base:])
        self.reserve_lent = True

    def drop_prefix_cache(self) -> int:
        """Forget every cached prefix (K/V that can no longer be trusted); only with no live block, as the chain
        hashes of a live sequence's later blocks build on its earlier ones. Returns how many entries were dropped."""
        assert all(b.ref_count == 0 for b in self.blocks), "dropping the prefix cache under live blocks"
        return sum(self._evict(block) for block in self.blocks)

    def evict_free_reserve(self) -> int:
        """Drop prefix-cache entries held by free reserve blocks. Returns how many were evicted."""
        return sum(self._evict(self.blocks[block_id]) for block_id in self.free_reserve)

    def plan_migration(self) -> dict[int, int]:
        """Map each live reserve block to a free base block (as many as base has room for).
        The caller copies the KV on the device, then `apply_migration`."""
        live = self.reserve_blocks_in_use()
        plan: dict[int, int] = {}
        for src in live[: len(self.free_base)]:
            dst = self._take_free()
            assert not self.is_reserve(dst.block_id)
            plan[src] = dst.block_id
        return plan

    def apply_migration(self, plan: dict[int, int], seqs: Iterable[BlockOwner]) -> None:
        self._move(plan, seqs)
        for src in plan:
            self.free_reserve[src] = None

    def _move(self, plan: dict[int, int], seqs: Iterable[BlockOwner]) -> None:
        """Point the sequences' tables and the prefix cache at each block's destination; sources end empty."""
        for seq in seqs:
            seq.block_table = [plan.get(b, b) for b in seq.block_table]
        for src, dst in plan.items():
            s, d = self.blocks[src], self.blocks[dst]
            d.ref_count, d.hash, d.token_ids = s.ref_count, s.hash, s.token_ids
            if s.hash is not None and self.hash_to_block.get(s.hash) == src:
                self.hash_to_block[s.hash] = dst
            s.ref_count, s.hash, s.token_ids = 0, None, None

    def begin_reclaim(self) -> None:
        """From now on the reserve hands out nothing; its live blocks must be migrated or freed."""
        assert self.reserve_lent
        self.reserve_draining = True

    def grant(self, n: int) -> None:
        """The reserve's first `n` blocks become base blocks (their memory is mapped for good). Only while the
        reserve is not lent, so they hold nothing."""
        assert not self.reserve_lent and 0 <= n <= self.num_reserve
        for block_id in range(self.num_base, self.num_base + n):
            del self.free_reserve[block_id]
            self.free_base[block_id] = None
        self.num_base += n
        self.num_reserve -= n

    def begin_ungrant(self, n: int) -> dict[int, int]:
        """Start giving the base's last `n` blocks back to the reserve: they hand out nothing from now on, and
        the returned plan maps each live one to a free block below them. The caller must have made room (every
        live block of the region must find a free one below) and copies the KV on the device before `end_ungrant`."""
        assert not self.reserve_lent and 0 <= n <= self.num_base
        start = self.num_base - n
        for block_id in range(start, self.num_base):
            if self.blocks[block_id].ref_count == 0:
                self.free_base.pop(block_id, None)
                self._evict(self.blocks[block_id])
        live = [b for b in range(start, self.num_base) if self.blocks[b].ref_count > 0]
        assert len(live) <= len(self.free_base), "no room below the region to move its live blocks to"
        return {src: self._take_free().block_id for src in live}

    def end_ungrant(self, n: int, plan: dict[int, int], seqs: Iterable[BlockOwner]) -> None:
        """Move the live blocks as planned and make the region the reserve's first `n` blocks (free, no hash)."""
        self._move(plan, seqs)
        start = self.num_base - n
        self.num_base, self.num_reserve = start, self.num_reserve + n
        self.free_reserve = OrderedDict([(b, None) for b in range(start, start + n)] + list(self.free_reserve.items()))

    def live_blocks_in(self, start: int, stop: int) -> int:
        return sum(1 for b in self.blocks[start:stop] if b.ref_count > 0)

    def reclaim_reserve(self) -> int:
        """Returns how many prefix-cache entries were evicted from the reserve."""
        assert self.reserve_lent
        assert not self.reserve_blocks_in_use(), "live blocks left in the reserve at reclaim"
        evicted = self.evict_free_reserve()
        self.reserve_lent = False
        self.reserve_draining = False
        return evicted
