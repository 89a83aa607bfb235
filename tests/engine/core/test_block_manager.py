"""BlockManager over integers: exact block ids, ref counts, the prefix cache's eviction order."""
import pytest

from pagoda.engine.core.block_manager import BlockManager, KVGroup, kv_groups
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.sequence import BlockTable, Sequence


def seq(name, n_prompt, max_tokens=8, priority=0):
    start = 1000 * sum(map(ord, name))  # distinct prompts: no prefix sharing between test sequences
    return Sequence(name, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    priority=priority)


def test_allocate_append_free_exact_ids():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a, b = seq("a", 5), seq("b", 4)
    assert bm.can_allocate(a, 5)
    bm.allocate(a, 5)
    assert a.block_table == [0, 1]
    bm.allocate(b, 4)
    assert b.block_table == [2]
    assert [bm.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 0, 0, 0]
    bm.append(a, 8)  # still fits in block 1
    assert a.block_table == [0, 1]
    bm.append(a, 9)
    assert a.block_table == [0, 1, 3]
    assert a.block_table.slot(8, 4) == 12 and a.block_table.slot(5, 4) == 5
    s = bm.stats()
    assert (s.num_total_blocks, s.num_free_blocks, s.num_used_blocks) == (6, 2, 4)
    assert s.num_wasted_slots == 4 * 4 - (9 + 4)
    assert not bm.can_append(b, 4 + 3 * 4)  # needs 3 more, 2 free
    bm.free(a)
    assert a.block_table == [] and bm.blocks[0].is_free
    # freed tail first: the free list (least recently used first) is now 4, 5, 3, 1, 0
    assert list(bm.free_block_ids) == [4, 5, 3, 1, 0]
    bm.append(b, 12)
    assert b.block_table == [2, 4, 5]
    bm.free(b)
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_double_free_is_caught():
    bm = BlockManager(2, 4)
    a = seq("a", 3)
    bm.allocate(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_tables = [BlockTable(table)]
    with pytest.raises(AssertionError):
        bm.free(a)


# ---- prefix caching ----

def toks(name, ids, max_tokens=4):
    return Sequence(name, list(ids), SamplingParams(max_tokens=max_tokens))


def _prefill(bm, s):
    """Admit and fully compute a prompt, as the scheduler and runner would."""
    hits = bm.match_prefix(s)
    bm.allocate(s, s.num_tokens, hits)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return hits


def test_prefix_hits_share_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = toks("a", range(10))  # blocks: [0..3] [4..7] [8, 9]
    assert _prefill(bm, a) == [] and a.block_table == [0, 1, 2]
    b = toks("b", list(range(8)) + [50, 51, 52])  # shares two full blocks
    hits = bm.match_prefix(b)
    assert hits == [0, 1] and bm.can_allocate(b, 11, hits)
    bm.allocate(b, 11, hits)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    c = toks("c", list(range(4)) + [99] * 5)  # shares the first block only
    assert bm.match_prefix(c) == [0]
    # an 8-token prompt equal to a's first 8: only block 0 is reused, its last token is recomputed
    d = toks("d", range(8))
    assert bm.match_prefix(d) == [0]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.stats().num_cached_blocks == 2  # blocks 0 and 1 hold the prefix still


def test_cached_blocks_evicted_lru_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = toks("a", [1, 2, 3, 4, 5])  # full blocks 0 [1,2], 1 [3,4]; partial block 2
    _prefill(bm, a)
    bm.free(a)  # free list: 3, then a's tail first: 2, 1, 0
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = toks("b", [7, 8, 9])  # needs 2 new blocks: takes 3 and 2 (never cached), no eviction
    _prefill(bm, b)
    assert b.block_table == [3, 2]
    assert bm.match_prefix(toks("x", [1, 2, 3, 4, 5])) == [0, 1]
    c = toks("c", [20, 21, 22])  # needs 2 blocks; only cached ones left: evicts 1 (LRU), then 0
    _prefill(bm, c)
    assert c.block_table == [1, 0]
    assert bm.match_prefix(toks("x", [1, 2, 3, 4, 5])) == []


def test_reusing_a_cached_free_block_takes_it_off_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = toks("a", [1, 2, 3])
    _prefill(bm, a)
    bm.free(a)
    b = toks("b", [1, 2, 9, 9, 9])  # reuses block 0, needs 2 more: exactly the 2 others
    hits = bm.match_prefix(b)
    assert hits == [0] and bm.can_allocate(b, 5, hits)
    assert not bm.can_allocate(toks("c", [5] * 7), 7)
    bm.allocate(b, 5, hits)
    assert sorted(b.block_table) == [0, 1, 2] and bm.num_free_blocks == 0




# ---- a sliding window: blocks no later query reads are given back ----

def test_a_window_gives_back_the_blocks_behind_it_exact_ids():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False, windows=(6,))
    a = seq("a", 10)
    bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 10  # the next query, at 10, reads keys 5..10: block 0 is behind it
    bm.append(a, 11)
    assert a.block_table == [-1, 1, 2] and list(bm.free_block_ids) == [3, 4, 5, 0]
    a.num_computed_tokens = 12  # reads 7..12: still from block 1; a fourth block for position 12
    bm.append(a, 13)
    assert a.block_table == [-1, 1, 2, 3]
    a.num_computed_tokens = 16  # reads 11..16: blocks 2 on; 1 given back, 4 taken for position 16
    bm.append(a, 17)
    assert a.block_table == [-1, -1, 2, 3, 4] and list(bm.free_block_ids) == [5, 0, 1]
    s = bm.stats()
    assert (s.num_used_blocks, s.num_wasted_slots) == (3, 3 * 4 - (17 - 8))
    bm.free(a)  # the given-back entries are not freed again
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks)
    assert a.block_table.num_released == 0


def test_a_window_fits_a_prompt_longer_than_the_cache_in_chunks():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False, windows=(5,))
    a = seq("a", 40)
    assert bm.num_fitting(a, 0, 40) == 16  # four blocks from position 0
    bm.allocate(a, 16)
    a.num_computed_tokens = 16  # next from 16, reading keys 12..: blocks 0-2 can go back
    assert not bm.can_append(a, 40) and bm.num_fitting(a, 16, 24) == 12
    assert bm.can_append(a, 28)
    bm.append(a, 28)
    assert a.block_table == [-1, -1, -1, 3, 0, 1, 2] and bm.num_free_blocks == 0
    # without a window, nothing is cut: the chunk fits or waits
    assert BlockManager(4, 4).num_fitting(seq("b", 40), 0, 40) == 40


def test_a_window_keeps_a_given_back_block_cached_for_a_prefix_hit():
    bm = BlockManager(num_blocks=8, block_size=4, windows=(5,))
    a = seq("a", 12)
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.register_full_blocks(a)
    bm.append(a, 13)
    assert a.block_table[:2] == [-1, -1] and bm.stats().num_cached_blocks == 2
    b = Sequence("b", list(a.token_ids), SamplingParams(max_tokens=8))
    # the first two blocks are cached whole (the third is held by a); the query at 8 reads keys 4.. only
    assert bm.match_prefix(b) == [-1, 1]


# ---- KV groups: a model mixing sliding and full layers holds a table per group, from one pool ----

def test_layers_are_grouped_by_window_in_groups_as_large_as_the_rarest():
    gemma3 = [16] * 5 + [0] + [16] * 5 + [0]  # five sliding layers to one full, twice
    assert kv_groups(gemma3) == (KVGroup(0, (5, 11)), KVGroup(16, (0, 1)), KVGroup(16, (2, 3)), KVGroup(16, (4, 6)),
                                 KVGroup(16, (7, 8)), KVGroup(16, (9, 10)))
    assert kv_groups([0] * 4) == (KVGroup(0, (0, 1, 2, 3)),)
    assert kv_groups([8, 0, 8]) == (KVGroup(0, (1,)), KVGroup(8, (0,)), KVGroup(8, (2,)))


def test_a_sliding_group_gives_back_its_past_while_the_full_group_keeps_the_context_exact_ids():
    bm = BlockManager(num_blocks=12, block_size=4, windows=(0, 5))
    a = seq("a", 10)
    bm.allocate(a, 10)
    assert a.block_tables == [[0, 1, 2], [3, 4, 5]]
    a.num_computed_tokens = 10  # the next query, at 10, reads keys 6..10: the sliding group's block 0 goes back
    bm.append(a, 11)
    assert a.block_tables == [[0, 1, 2], [-1, 4, 5]] and list(bm.free_block_ids) == [6, 7, 8, 9, 10, 11, 3]
    a.num_computed_tokens = 12
    bm.append(a, 13)  # a block more in each group, the sliding group's block 1 back
    assert a.block_tables == [[0, 1, 2, 6], [-1, -1, 5, 7]]
    s = bm.stats()
    assert (s.num_used_blocks, s.num_used_blocks_by_group) == (6, (4, 2))
    assert s.num_wasted_slots == 6 * 4 - (13 + 13 - 8)
    assert not bm.can_append(a, 4 * 7 + 1)  # 4 more blocks in each group: 8, 6 free and 2 to give back
    assert bm.can_append(a, 4 * 6 + 1)
    bm.free(a)
    assert bm.num_free_blocks == 12 and bm.stats().num_used_blocks_by_group == (0, 0)


def test_a_prefix_hit_needs_what_every_group_still_reads():
    bm = BlockManager(num_blocks=12, block_size=4, windows=(0, 5))
    a = seq("a", 12)
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.append(a, 13)
    assert a.block_tables == [[0, 1, 2, 6], [-1, -1, 5, 7]]
    bm.register_full_blocks(a)  # blocks 0-2: the full group's all, the sliding group's block 2 (0 and 1 went back)
    b = Sequence("b", a.token_ids[:12] + [7], SamplingParams(max_tokens=4))
    hits = bm.match_prefix(b)  # a query at 12 reads keys 8..: the sliding group needs its block 2 only
    assert hits == [0, 1, 2] and hits.by_group == ([0, 1, 2], [-1, -1, 5])
    c = Sequence("c", a.token_ids[:8] + [7], SamplingParams(max_tokens=4))
    assert bm.match_prefix(c) == []  # a query at 8 reads keys 4..: the sliding group's block 1 is gone
    assert bm.can_allocate(b, 13, hits)
    bm.allocate(b, 13, hits)
    assert b.block_tables == [[0, 1, 2, 8], [-1, -1, 5, 9]] and b.block_tables[1].num_released == 2
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 5)] == [2, 2, 2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 12 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_state_slots_one_per_sequence_from_admission_to_free():
    """Linear-attention layers: a sequence holds a state slot while it holds blocks; with every slot taken,
    a sequence cannot be admitted however many blocks are free."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = seq("a", 5), seq("b", 3), seq("c", 2)
    bm.allocate(a, 5)
    bm.allocate(b, 3)
    assert (a.state_slot, b.state_slot) == (0, 1)
    assert not bm.can_allocate(c, 2) and bm.num_free_blocks == 5
    s = bm.stats()
    assert (s.num_state_slots, s.num_used_state_slots) == (2, 2)
    bm.free(a)  # finished, aborted or preempted alike
    assert a.state_slot is None and bm.can_allocate(c, 2)
    bm.allocate(c, 2)
    assert c.state_slot == 0
    bm.free(b)
    bm.free(c)
    assert list(bm.free_state_slots) == [1, 0] and bm.stats().num_used_state_slots == 0
    assert BlockManager(num_blocks=8, block_size=4).can_allocate(seq("d", 4), 4)  # a model without states
