"""ModelRunner's input preparation (no model run): the flat batch of a step, exactly."""
import pytest

from pagoda.engine import LLM
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.scheduler import SchedulerOutput
from pagoda.engine.core.sequence import BlockTable, Sequence


@pytest.fixture(scope="module")
def runner(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=16, block_size=4,
            attention_backend="torch").engine.runner


def _seq(name: str, num_tokens: int, num_computed: int, blocks: list[int]) -> Sequence:
    s = Sequence(name, [100 + i for i in range(num_tokens)], SamplingParams(max_tokens=8))
    s.num_computed_tokens, s.block_tables = num_computed, [BlockTable(blocks)]
    return s


def test_prepare_inputs_of_a_mixed_batch(runner):
    """Two decodes, a prefill chunk that samples nothing, and a 3-token query that samples 3 (as a
    speculative verification would): ids, positions, slots (block size 4), attention metadata and
    the rows whose logits are sampled."""
    d1, d2 = _seq("d1", 6, 5, [3, 7]), _seq("d2", 3, 2, [9])
    chunk = _seq("p", 10, 4, [1, 2, 5])  # positions 4..7 of a 10-token prompt
    multi = _seq("m", 8, 5, [4, 6])  # positions 5..7
    sched = SchedulerOutput([d1, d2, chunk, multi], num_new_tokens=[1, 1, 4, 3], num_sampled=[1, 1, 0, 3])
    input_ids, positions, meta, logits_idx = runner._prepare_inputs(sched)
    assert input_ids.tolist() == [105, 102, 104, 105, 106, 107, 105, 106, 107]
    assert positions.tolist() == [5, 2, 4, 5, 6, 7, 5, 6, 7]
    assert meta.slot_mapping.tolist() == [7 * 4 + 1, 9 * 4 + 2, 8, 9, 10, 11, 6 * 4 + 1, 26, 27]
    assert meta.num_decode_tokens == 2
    assert meta.decode_block_tables.tolist() == [[3, 7, -1], [9, -1, -1]]
    assert meta.decode_context_lens.tolist() == [6, 3]
    assert meta.prefill_block_tables.tolist() == [[1, 2, 5], [4, 6, -1]]
    assert meta.prefill_query_start_loc.tolist() == [0, 4, 7]
    assert meta.prefill_context_lens.tolist() == [8, 8]
    assert (meta.max_query_len, meta.max_context_len) == (4, 8)
    assert logits_idx.tolist() == [0, 1, 6, 7, 8]


def test_a_decode_step_samples_every_row_without_a_gather(runner):
    seqs = [_seq("a", 6, 5, [3, 7]), _seq("b", 2, 1, [0])]
    input_ids, positions, meta, logits_idx = runner._prepare_inputs(
        SchedulerOutput(seqs, num_new_tokens=[1, 1], num_sampled=[1, 1]))
    assert logits_idx is None and meta.num_decode_tokens == 2
    assert positions.tolist() == [5, 1] and meta.slot_mapping.tolist() == [29, 1]
    assert meta.prefill_query_start_loc.tolist() == [0] and meta.max_query_len == 1


def test_a_prompt_chunk_that_reaches_its_end_samples_its_last_row(runner):
    s = _seq("a", 5, 0, [2, 3])
    _, positions, meta, logits_idx = runner._prepare_inputs(
        SchedulerOutput([s], num_new_tokens=[5], num_sampled=[1]))
    assert positions.tolist() == [0, 1, 2, 3, 4] and meta.slot_mapping.tolist() == [8, 9, 10, 11, 12]
    assert meta.num_decode_tokens == 0 and logits_idx.tolist() == [4]
