"""Pipeline parallelism on CPU (gloo): 2 stages, and 2 stages of 2 tensor-parallel ranks each, greedy float32
output token-identical to transformers (with chunked prefill and preemption too); micro-batches in flight
overlap, shown by the stages' own timestamps; two "nodes" (a stage each) in one process tree; what is not
supported is refused naming the flag."""

import pytest

from grpc_fixtures import rendezvous_port
from oracle import greedy
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.engine.executor.node import Node

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 200, 14], list(range(3, 40)), list(range(100, 121)), [42, 17, 99]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _generate(path, **options):
    llm = LLM(path, dtype="float32", **options)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.engine
    finally:
        llm.engine.close()


def test_two_stages_of_two_ranks_match_transformers(checkpoint):
    # with chunked prefill (16-token steps) and preemption (14 blocks of 4 hold fewer than the 4 requests) and
    # batches in flight: a sequence in one is neither scheduled again nor preempted until its tokens are back
    path = checkpoint("llama")
    got, engine = _generate(path, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16,
                            pipeline_parallel_size=2, tensor_parallel_size=2)
    assert got == greedy(path, PROMPTS, 12)
    assert engine.scheduler.num_preemptions > 0
    assert not engine.scheduler.in_flight and not engine.in_flight


def test_two_stages_match_transformers_and_their_micro_batches_overlap(tmp_path):
    # 4 layers a stage, wide enough that a stage's work outlasts the driver's scheduling between two batches
    path = build_tiny_checkpoint(str(tmp_path / "deep"), "llama", initializer_range=0.3, num_hidden_layers=8,
                                 hidden_size=256, intermediate_size=1024)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))]  # EOS stops
        first = llm.engine.runner.pipeline_times()  # (micro-batch, start, end) per stage, time.monotonic()
        second = llm.engine.workers.call("pipeline_times")[0]
    finally:
        llm.engine.close()
    assert got == greedy(path, PROMPTS, 12)
    assert [b for b, _, _ in first] == [b for b, _, _ in second] == list(range(len(first)))
    assert all(s0 <= e0 and s1 <= e1 and e0 <= s1 for (_, s0, e0), (_, s1, e1) in zip(first, second))
    # stage 0 worked on micro-batch i+1 while stage 1 worked on micro-batch i (a synchronous pipeline
    # never: stage 0 would start i+1 only once i's output came back from stage 1)
    overlapped = [i for i in range(len(first) - 1) if first[i + 1][1] < second[i][2] and second[i][1] < first[i + 1][2]]
    assert overlapped, (first, second)



def test_a_stage_per_node(checkpoint):
    """--nnodes 2 with --pipeline-parallel-size 2: node 0 (this process) runs stage 0, node 1 stage 1; a mixture
    of experts, whose checkpoint names its experts its own way (each stage still reads only its layers')."""
    path = checkpoint("mixtral")
    want = greedy(path, PROMPTS, 12)
    flags = dict(model=path, dtype="float32", device="cpu", num_kv_blocks=64, pipeline_parallel_size=2, nnodes=2,
                 master_port=rendezvous_port())
    node = Node(EngineConfig(**flags, node_rank=1))
    try:
        assert list(node.ranks) == [1]
        got, _ = _generate(path, **{k: v for k, v in flags.items() if k not in ("model", "dtype")})
        assert got == want
        assert node.procs[0].wait(30) == 0  # told to stop by the driver
    finally:
        node.close()


@pytest.mark.parametrize("options, message", [
    (dict(speculative_config={"method": "ngram"}), "speculative_config is not supported with pipeline_parallel_size"),
    (dict(lora_modules={"a": "/nonexistent"}), "lora_modules / allow_lora_loading are not supported with pipeline"),
    (dict(pipeline_parallel_size=3, nnodes=2, master_port=29500),
     (r"tensor_parallel_size x pipeline_parallel_size 3 must be a multiple of nnodes 2 \(--tensor-parallel-size, "
      r"--pipeline-parallel-size, --nnodes\)")),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
])
def test_what_is_not_supported_is_refused_naming_the_flag(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"pipeline_parallel_size": 2, **options})


def test_more_stages_than_layers_or_another_family_are_refused_before_any_rank_starts(checkpoint):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 exceeds the model's 2 decoder layers "
                                         r"\(--pipeline-parallel-size\)"):
        LLM(checkpoint("llama"), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel runs on one stage for now \(--pipeline-parallel-size 1\)"):
        LLM(checkpoint("gpt2"), pipeline_parallel_size=2)
