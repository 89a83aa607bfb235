"""Paged KV-cache bookkeeping: which physical blocks each sequence holds, and which full
blocks hold a known prefix (so a later request can reuse their KV).

Physical blocks are fixed-size pages of the KV cache. A sequence's block table maps its
logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a physical block number:

    logical:  [ 0 ][ 1 ][ 2 ]        token at position p -> slot
    physical: [ 7 ][ 2 ][ 9 ]        block_table[p // block_size] * block_size + p % block_size

A full block is content-addressed by a hash chained over every token up to its end. When no
sequence holds it (ref_count 0) it stays cached in the free list, which is kept in least
recently used order, and is only overwritten when a free block is needed.

A sliding-window layer (it attends to the last `window` tokens at most) never reads a block
behind its window again: a sequence gives those blocks back, and its table keeps NULL there:

    logical:  [ 0 ][ 1 ][ 2 ][ 3 ]   window 20, block 16, next query at 42 (reads keys 23..42)
    physical: [ - ][ 2 ][ 9 ][ 4 ]   block 0 (keys 0..15) freed: its KV stays cached for a prefix hit

A model mixing sliding and full layers (Gemma 2/3, gpt-oss) has its layers in KV groups
(kv_groups: one window each, the same number of layers each), and a sequence holds one table per
group, all drawn from the one pool: a block handed to a group holds block_size tokens of each of
that group's layers. So the sliding groups hold a window each while the full group holds the
context (vLLM's hybrid KV cache manager). A prefix hit needs, in every group, the blocks that
group still reads.

Pure Python over integers: no tensors here.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass

from pagoda.engine.core.block_hash import block_hash, none_hash
from pagoda.engine.core.sequence import NULL_BLOCK, BlockTable, Sequence


@dataclass(frozen=True)
class KVGroup:
    """Attention layers whose KV one block table maps: the same window, and as many layers as every other
    group has at most (a block of the pool holds that many layers' KV, for any group)."""
    window: int  # 0: full attention; else the sliding window its layers attend within
    layers: tuple[int, ...]  # the model's attention layers (0, 1, ... in order) whose KV it holds


def kv_groups(windows: list[int]) -> tuple[KVGroup, ...]:
    """Layers by window (full attention first), cut into groups as large as the rarest window's layers."""
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    size = min(map(len, by_window.values()))
    return tuple(KVGroup(w, tuple(layers[a:a + size]))
                 for w, layers in sorted(by_window.items()) for a in range(0, len(layers), size))


@dataclass
class PhysicalTokenBlock:
    block_number: int
    ref_count: int = 0  # sequences holding this block
    hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # the block's tokens, to rule out hash collisions
    group: int = 0  # the KV group whose layers' KV it holds (while held, or cached)

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
    num_used_blocks_by_group: tuple[int, ...] = ()  # per KV group (one entry: a single group)
    num_state_slots: int = 0  # linear-attention state slots (0: a model without them)
    num_used_state_slots: int = 0


class Hits(list):
    """A cached prefix: the first KV group's block numbers for its blocks 0..k-1 (len(hits) is k), and
    `by_group`, every group's (NULL_BLOCK where a sliding group no longer reads the block)."""
    by_group: tuple[list[int], ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int, ...] = (0,), hash_seed: str = "", num_state_slots: int = 0):
        self.block_size = block_size
        self.none_hash = none_hash(hash_seed)  # the parent of a sequence's first block (engine/core/block_hash.py)
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)  # per KV group: 0 full attention, else the sliding window it keeps
        self.num_groups = len(self.windows)
        self.blocks = [PhysicalTokenBlock(i) for i in range(num_blocks)]
        # free blocks, least recently used first; an ordered dict gives O(1) pop, push and removal
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: list[dict[int, int]] = [{} for _ in self.windows]  # per group: block hash -> block number
        self.in_flight: dict[int, Sequence] = {}  # block hash -> the sequence computing that block now
        self._num_slots: dict[str, int] = {}  # seq_id -> token slots reserved (in each group)
        self._num_released_slots = 0  # of those, in blocks given back (a sliding window's past)
        self._num_cached_free = 0  # free blocks that still hold a prefix
        self._num_used = [0] * self.num_groups  # blocks held, per group
        self.events: list | None = None  # KV-cache events on: what is stored and evicted (engine/core/kv_events.py)
        self.num_state_slots = num_state_slots  # linear-attention states, one per running sequence (0: none)
        self.free_state_slots = deque(range(num_state_slots))

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
            parent = hs[-1] if hs else self.none_hash
            hs.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.hash_seed))
        return hs

    def match_prefix(self, seq: Sequence) -> Hits:
        """Cached blocks holding the longest known prefix of seq's tokens that every group still has what it
        reads of. The last token is never covered: it has to be computed for its logits."""
        if not self.enable_prefix_caching:
            return Hits()
        n, bs = (seq.num_tokens - 1) // self.block_size, self.block_size
        hashes = self._hashes(seq, n)[:n]
        found = []  # per group: the cached block of each of the first n blocks, or None
        for cached in self.cached:
            ids = [cached.get(h) for h in hashes]
            found.append([b if b is not None and self.blocks[b].token_ids == tuple(seq.token_ids[i * bs:(i + 1) * bs])
                          else None for i, b in enumerate(ids)])
        runs = [_runs(ids) for ids in found]  # per group and block: cached blocks in a row ending there
        for k in range(n, 0, -1):
            firsts = [self._first_needed(g, k * bs) for g in range(self.num_groups)]
            if all(run[k - 1] >= k - first for run, first in zip(runs, firsts)):
                by_group = tuple([NULL_BLOCK] * first + ids[first:k] for ids, first in zip(found, firsts))
                hits = Hits(by_group[0])
                hits.by_group = by_group
                return hits
        return Hits()

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
        n, bs = seq.num_computed_tokens // self.block_size, self.block_size
        done = seq.num_registered_blocks
        if not self.enable_prefix_caching or n <= done:  # no block filled since
            return
        hashes = self._hashes(seq, n)
        for i in range(done, n):
            if self.in_flight.get(hashes[i]) is seq:
                del self.in_flight[hashes[i]]
        for cached, table in zip(self.cached, seq.block_tables):
            for i in range(done, n):
                if table[i] == NULL_BLOCK:  # out of the window before it was registered: not held
                    continue
                h, block = hashes[i], self.blocks[table[i]]
                if h not in cached and block.hash is None:
                    block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    cached[h] = block.block_number
                    if self.events is not None:
                        self.events.append(("stored", block.group, h, hashes[i - 1] if i else None, block.token_ids,
                                            seq.hash_seed, seq.adapter, seq.adapter_uid))
        seq.num_registered_blocks = n

    # ---- allocation ----

    def _num_reclaimed(self, hits: Hits) -> int:
        """Of a prefix hit's blocks, those in the free list (taking them leaves fewer free)."""
        return sum(1 for ids in hits.by_group for b in ids if b != NULL_BLOCK and self.blocks[b].ref_count == 0)

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: Hits = Hits()) -> bool:
        """Whether a sequence holding no blocks can get room for its first num_tokens tokens,
        reusing the cached blocks `hits` for its prefix."""
        needed = self.num_groups * (self.num_blocks_for(num_tokens) - len(hits))
        has_state = not self.num_state_slots or bool(self.free_state_slots)
        return has_state and needed <= self.num_free_blocks - self._num_reclaimed(hits)

    def allocate(self, seq: Sequence, num_tokens: int, hits: Hits = Hits()) -> None:
        assert not seq.block_table, f"{seq.seq_id} already holds blocks"
        seq.block_tables = [BlockTable() for _ in self.windows]
        for g, (table, ids) in enumerate(zip(seq.block_tables, hits.by_group or [[]] * self.num_groups)):
            for block_id in ids:
                if block_id != NULL_BLOCK:
                    self._take(block_id, g)
            table.extend(ids)
            table.num_released = ids.count(NULL_BLOCK)
            self._num_released_slots += table.num_released * self.block_size
        seq.num_registered_blocks = len(hits)
        if self.num_state_slots:
            seq.state_slot = self.free_state_slots.popleft()
        if self.enable_prefix_caching:
            for h in self._hashes(seq, seq.num_tokens // self.block_size)[len(hits):]:
                self.in_flight.setdefault(h, seq)
        self._grow(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a running sequence can grow to hold num_tokens tokens in all."""
        held = len(seq.block_table)
        return num_tokens <= held * self.block_size or self.num_groups * (self.num_blocks_for(num_tokens) - held) <= (
            self.num_free_blocks + self._num_releasable(seq, seq.num_computed_tokens))

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self.release_before(seq, seq.num_computed_tokens)
        self._grow(seq, num_tokens)

    # ---- sliding windows ----

    def num_fitting(self, seq: Sequence, start: int, num_tokens: int, hits: Hits = Hits()) -> int:
        """Of num_tokens new tokens from position `start`, how many fit: with a sliding group, as many as the
        blocks the sequence holds or would free, and the free ones, hold (a long prompt then runs in chunks
        through a cache smaller than itself); without one, all of them (they fit, or wait)."""
        if not any(self.windows):
            return num_tokens
        if seq.block_table:
            held, spare = len(seq.block_table), self.num_free_blocks + self._num_releasable(seq, start)
        else:
            held, spare = len(hits), self.num_free_blocks - self._num_reclaimed(hits)
        room = held + spare // self.num_groups  # blocks per group
        return max(0, min(num_tokens, room * self.block_size - start))

    def _first_needed(self, group: int, pos: int) -> int:
        """The first block of a group that a query at position `pos` or later reads."""
        window = self.windows[group]
        return max(0, pos - window + 1) // self.block_size if window else 0

    def _num_releasable(self, seq: Sequence, pos: int) -> int:
        n = 0
        for g, table in enumerate(seq.block_tables):
            end = min(self._first_needed(g, pos), len(table))
            n += sum(1 for b in table[table.num_released:end] if self.blocks[b].ref_count == 1)
        return n

    def release_before(self, seq: Sequence, pos: int) -> None:
        """Give back the blocks that no query at `pos` or later reads (a sliding window's past)."""
        for g, table in enumerate(seq.block_tables):
            end = min(self._first_needed(g, pos), len(table))
            for i in range(table.num_released, end):
                self._put_back(table[i])
                table[i] = NULL_BLOCK
            if end > table.num_released:
                self._num_released_slots += (end - table.num_released) * self.block_size
                table.num_released = end

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative decoding's rollback: give back the tail blocks seq no longer needs for its first
        num_tokens tokens (those held for rejected proposals; never hashed, so reused first)."""
        keep = self.num_blocks_for(num_tokens)
        for table in seq.block_tables:
            while len(table) > keep:
                block_id = table.pop()
                block = self.blocks[block_id]
                assert block.hash is None and block.ref_count == 1, f"block {block_id} is not a speculative tail"
                block.ref_count = 0
                self._num_used[block.group] -= 1
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
        self._num_slots[seq.seq_id] = num_tokens

    def free(self, seq: Sequence) -> None:
        # Tail blocks go back first, so they are evicted before the prefix blocks that lead to them.
        for table in seq.block_tables:
            for block_id in reversed(table[table.num_released:]):
                self._put_back(block_id)
            self._num_released_slots -= table.num_released * self.block_size
        for h in seq.block_hashes[seq.num_registered_blocks:]:
            if self.in_flight.get(h) is seq:
                del self.in_flight[h]
        seq.block_tables = [BlockTable()]
        seq.num_registered_blocks = 0
        self._num_slots.pop(seq.seq_id, None)
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def _take(self, block_id: int, group: int) -> None:
        """One more holder of a cached block (out of the free list if it was free)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            self._num_cached_free -= 1
            self._num_used[group] += 1
        block.ref_count += 1

    def _put_back(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            self._num_cached_free += block.hash is not None
            self._num_used[block.group] -= 1

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_blocks_for(num_tokens) - len(seq.block_table)  # in every group
        if missing * self.num_groups > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.seq_id} needs {missing * self.num_groups}, "
                               f"{self.num_free_blocks} free")
        for g, table in enumerate(seq.block_tables):
            for _ in range(missing):
                block_id, _ = self.free_block_ids.popitem(last=False)  # least recently used
                block = self.blocks[block_id]
                if block.hash is not None:  # evict its cached prefix
                    if self.cached[block.group].get(block.hash) == block_id:
                        del self.cached[block.group][block.hash]
                        if self.events is not None:
                            self.events.append(("removed", block.group, block.hash))
                    block.hash, block.token_ids = None, ()
                    self._num_cached_free -= 1
                block.ref_count, block.group = 1, g
                self._num_used[g] += 1
                table.append(block_id)
        self._num_slots[seq.seq_id] = max(self._num_slots.get(seq.seq_id, 0), num_tokens)

    def stats(self) -> BlockStats:
        used = len(self.blocks) - self.num_free_blocks
        slots = sum(self._num_slots.values()) * self.num_groups - self._num_released_slots
        return BlockStats(num_total_blocks=len(self.blocks), num_free_blocks=self.num_free_blocks,
                          num_used_blocks=used, num_wasted_slots=max(0, used * self.block_size - slots),
                          num_cached_blocks=self._num_cached_free, num_used_blocks_by_group=tuple(self._num_used),
                          num_state_slots=self.num_state_slots,
                          num_used_state_slots=self.num_state_slots - len(self.free_state_slots))


def _runs(ids: list) -> list[int]:
    """Per entry: how many entries in a row up to and including it are not None."""
    out, run = [], 0
    for b in ids:
        run = run + 1 if b is not None else 0
        out.append(run)
    return out
