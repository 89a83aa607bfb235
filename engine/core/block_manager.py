"""Paged KV-cache bookkeeping: which physical blocks each sequence holds, and which full
blocks hold a known prefix (so a later request can reuse their KV).

Physical blocks are fixed-size pages of the KV cache. A sequence's block table maps its
logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a physical block number:

    logical:  [ 0 ][ 1 ][ 2 ]        token at position p -> slot
    physical: [ 7 ][ 2 ][ 9 ]        block_table[p // block_size] * block_size + p % block_size

A full block is content-addressed by a hash chained over every token up to its end. When no
sequence holds it (ref_count 0) it stays cached in the free list, which is kept in least
recently used order, and is only overwritten when a free block is needed.

With a sliding window (every layer attends to the last `window` tokens at most: Mistral v0.1's
kind), a sequence gives back the blocks no later query reads, and its table keeps NULL there:

    logical:  [ 0 ][ 1 ][ 2 ][ 3 ]   window 20, block 16, next query at 42 (reads keys 23..42)
    physical: [ - ][ 2 ][ 9 ][ 4 ]   block 0 (keys 0..15) freed: its KV stays cached for a prefix hit

Pure Python over integers: no tensors here.
"""
from collections import OrderedDict
from dataclasses import dataclass

from pagoda.engine.core.sequence import NULL_BLOCK, BlockTable, Sequence


@dataclass
class PhysicalTokenBlock:
    block_number: int
    ref_count: int = 0  # sequences holding this block
    hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # the block's tokens, to rule out hash collisions

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0


@dataclass(frozen=True)
class BlockStats:
    num_total_blocks: int
    num_free_blocks: int  # not held by any sequence (cached ones included)
    num_used_blocks: int
    num_wasted_slots: int  # empty slots inside held, partly filled blocks
    num_cached_blocks: int  # free blocks that still hold a reusable prefix


def chain_hash(prev: int | None, tokens) -> int:
    return hash((prev, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # the sliding window every layer attends within (0: full attention somewhere)
        self.blocks = [PhysicalTokenBlock(i) for i in range(num_blocks)]
        # free blocks, least recently used first; an ordered dict gives O(1) pop, push and removal
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block number
        self.in_flight: dict[int, Sequence] = {}  # block hash -> the sequence computing that block now
        self._num_slots: dict[str, int] = {}  # seq_id -> token slots reserved
        self._num_released_slots = 0  # of those, in blocks given back (a sliding window's past)
        self._num_cached_free = 0  # free blocks that still hold a prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of seq's first num_blocks full blocks (memoised: tokens never change)."""
        hs, bs = seq.block_hashes, self.block_size
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(chain_hash(hs[-1] if hs else seq.hash_seed, seq.token_ids[i * bs:(i + 1) * bs]))
        return hs

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest known prefix of seq's tokens. The last token is never
        covered: it has to be computed for its logits."""
        if not self.enable_prefix_caching:
            return []
        n, bs, hits = (seq.num_tokens - 1) // self.block_size, self.block_size, []
        for i, h in enumerate(self._hashes(seq, n)[:n]):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def prefix_in_flight(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether the block after seq's cached prefix is being computed right now by another
        sequence: then waiting a step lets seq reuse it instead of computing it again."""
        n = (seq.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or len(hits) >= n:
            return False
        owner = self.in_flight.get(self._hashes(seq, n)[len(hits)])
        return owner is not None and owner is not seq

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make seq's newly completed (computed and full) blocks findable by later requests."""
        n = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or n <= seq.num_registered_blocks:  # no block filled since
            return
        hashes = self._hashes(seq, n)
        for i in range(seq.num_registered_blocks, n):
            if seq.block_table[i] == NULL_BLOCK:  # out of the window before it was registered: not held
                continue
            h, block = hashes[i], self.blocks[seq.block_table[i]]
            if self.in_flight.get(h) is seq:
                del self.in_flight[h]
            if h not in self.cached and block.hash is None:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                self.cached[h] = block.block_number
        seq.num_registered_blocks = max(seq.num_registered_blocks, n)

    # ---- allocation ----

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether a sequence holding no blocks can get room for its first num_tokens tokens,
        reusing the cached blocks `hits` for its prefix."""
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # leave the free list
        return self.num_blocks_for(num_tokens) - len(hits) <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        assert not seq.block_table, f"{seq.seq_id} already holds blocks"
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_registered_blocks = len(hits)
        if self.enable_prefix_caching:
            for h in self._hashes(seq, seq.num_tokens // self.block_size)[len(hits):]:
                self.in_flight.setdefault(h, seq)
        self.release_before(seq, len(hits) * self.block_size)
        self._grow(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a running sequence can grow to hold num_tokens tokens in all."""
        held = len(seq.block_table)
        return num_tokens <= held * self.block_size or self.num_blocks_for(num_tokens) - held <= (
            self.num_free_blocks + self._num_releasable(seq, seq.num_computed_tokens))

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self.release_before(seq, seq.num_computed_tokens)
        self._grow(seq, num_tokens)

    # ---- sliding window ----

    def num_fitting(self, seq: Sequence, start: int, num_tokens: int, hits: list[int] = ()) -> int:
        """Of num_tokens new tokens from position `start`, how many fit: with a window, as many as the
        blocks the sequence holds or would free, and the free ones, hold (a long prompt then runs in
        chunks through a cache smaller than itself); without one, all of them (they fit, or wait)."""
        if not self.window:
            return num_tokens
        if seq.block_table:
            room = len(seq.block_table) + self.num_free_blocks + self._num_releasable(seq, start)
        else:
            room = len(hits) + self.num_free_blocks - sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return max(0, min(num_tokens, room * self.block_size - start))

    def _first_needed(self, pos: int) -> int:
        """The first block that a query at position `pos` or later reads."""
        return max(0, pos - self.window + 1) // self.block_size if self.window else 0

    def _num_releasable(self, seq: Sequence, pos: int) -> int:
        end = min(self._first_needed(pos), len(seq.block_table))
        return sum(1 for b in seq.block_table[seq.num_released_blocks:end] if self.blocks[b].ref_count == 1)

    def release_before(self, seq: Sequence, pos: int) -> None:
        """Give back the blocks that no query at `pos` or later reads (a sliding window's past)."""
        end = min(self._first_needed(pos), len(seq.block_table))
        for i in range(seq.num_released_blocks, end):
            self._put_back(seq.block_table[i])
            seq.block_table[i] = NULL_BLOCK
        if end > seq.num_released_blocks:
            self._num_released_slots += (end - seq.num_released_blocks) * self.block_size
            seq.num_released_blocks = end

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative decoding's rollback: give back the tail blocks seq no longer needs for its first
        num_tokens tokens (those held for rejected proposals; never hashed, so reused first)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.hash is None and block.ref_count == 1, f"block {block_id} is not a speculative tail"
            block.ref_count = 0
            self.free_block_ids[block_id] = None
            self.free_block_ids.move_to_end(block_id, last=False)
        self._num_slots[seq.seq_id] = num_tokens

    def free(self, seq: Sequence) -> None:
        # Tail blocks go back first, so they are evicted before the prefix blocks that lead to them.
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._put_back(block_id)
        for h in seq.block_hashes[seq.num_registered_blocks:]:
            if self.in_flight.get(h) is seq:
                del self.in_flight[h]
        seq.block_table = BlockTable()
        self._num_released_slots -= seq.num_released_blocks * self.block_size
        seq.num_registered_blocks = seq.num_released_blocks = 0
        self._num_slots.pop(seq.seq_id, None)

    def _put_back(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            self._num_cached_free += block.hash is not None

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.seq_id} needs {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id, _ = self.free_block_ids.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached prefix
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
                self._num_cached_free -= 1
            block.ref_count = 1
            seq.block_table.append(block_id)
        self._num_slots[seq.seq_id] = max(self._num_slots.get(seq.seq_id, 0), num_tokens)

    def stats(self) -> BlockStats:
        used = len(self.blocks) - self.num_free_blocks
        slots = sum(self._num_slots.values()) - self._num_released_slots
        return BlockStats(num_total_blocks=len(self.blocks), num_free_blocks=self.num_free_blocks,
                          num_used_blocks=used, num_wasted_slots=max(0, used * self.block_size - slots),
                          num_cached_blocks=self._num_cached_free)
