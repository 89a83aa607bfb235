"""Paged KV-cache bookkeeping: which physical blocks each sequence holds.

Physical blocks are fixed-size pages of the KV cache. A sequence's block table maps its
logical block i (tokens i*block_size .. (i+1)*block_size - 1) to a physical block number:

    logical:  [ 0 ][ 1 ][ 2 ]        token at position p -> slot
    physical: [ 7 ][ 2 ][ 9 ]        block_table[p // block_size] * block_size + p % block_size

Pure Python over integers: no tensors here.
"""
from collections import deque
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass
class PhysicalTokenBlock:
    block_number: int
    ref_count: int = 0  # sequences holding this block

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0


@dataclass(frozen=True)
class BlockStats:
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_wasted_slots: int  # empty slots inside allocated, partly filled blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [PhysicalTokenBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # O(1) pop and push
        self._num_slots: dict[str, int] = {}  # req_id -> token slots reserved

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a sequence holding no blocks can get room for its first num_tokens tokens."""
        return self._num_missing(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        assert not seq.block_table, f"{seq.req_id} already holds blocks"
        self._grow(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a running sequence can grow to hold num_tokens tokens in all."""
        return self._num_missing(seq, num_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self._grow(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        # Tail blocks go back first, so the most recently written ones are reused last.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
        self._num_slots.pop(seq.req_id, None)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self._num_missing(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.req_id} needs {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id = self.free_block_ids.popleft()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        self._num_slots[seq.req_id] = max(self._num_slots.get(seq.req_id, 0), num_tokens)

    def stats(self) -> BlockStats:
        used = len(self.blocks) - self.num_free_blocks
        slots = sum(self._num_slots.values())
        return BlockStats(len(self.blocks), self.num_free_blocks, used, used * self.block_size - slots)
