"""Pooling beside sampling in the engine: pooled final hidden states equal transformers' own model's
(AutoModel's last_hidden_state, pooled by hand) in float32, whatever the chunking, prefix-cache hits
and generation beside them; every KV block is free afterwards."""
import numpy as np
import pytest
import torch
from pagoda.engine import LLM
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.inputs import make_request
from pagoda.engine.pooling import PoolingParams
from pagoda.engine.sampling_params import SamplingParams

PROMPTS = [list(range(40, 40 + n)) for n in (1, 5, 37, 70)]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hidden_states(path):
    """Each prompt's last_hidden_state from transformers' AutoModel: [num_tokens, hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def expected(h: torch.Tensor, method: str, normalize: bool, dims: int | None = None) -> np.ndarray:
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0], "all": h}[method]
    v = v[..., :dims] if dims else v
    return (torch.nn.functional.normalize(v, dim=-1) if normalize else v).numpy()


def llm(path, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=16, runner="all", **kw)


def run(engine: LLM, prompts, params) -> list:
    """Every request (a PoolingParams or a SamplingParams each) to the end: its last output."""
    reqs = [make_request(p, sp, model=engine._model, tokenizer=engine.tokenizer, request_id=str(i), stream=False)
            for i, (p, sp) in enumerate(zip(prompts, params))]
    for req in reqs:
        engine.engine.add_request(req)
    outs = {}
    while engine.engine.has_work():
        for out in engine.engine.step():
            outs[out.request_id] = out
    return [outs[r.request_id] for r in reqs]


def all_blocks_free(engine: LLM) -> bool:
    stats = engine.engine.block_manager.stats()
    return stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("method", ["last", "mean", "cls", "all"])
@pytest.mark.parametrize("budget", [512, 16])  # 16 tokens a step: the long prompts in chunks
def test_pooled_vectors_equal_transformers(path, hidden_states, method, budget):
    engine = llm(path, max_num_batched_tokens=budget)
    outs = run(engine, PROMPTS, [PoolingParams(method, normalize=False)] * len(PROMPTS))
    for out, h, p in zip(outs, hidden_states, PROMPTS):
        assert out.finished and out.token_ids == [] and out.num_prompt_tokens == len(p)
        assert out.embedding.dtype == np.float32
        np.testing.assert_allclose(out.embedding, expected(h, method, False), rtol=1e-4, atol=1e-4)
    assert all_blocks_free(engine)


def test_normalize_and_dimensions_truncate_then_renormalize(path, hidden_states):
    engine = llm(path)
    params = [PoolingParams("mean", normalize=True, dimensions=24), PoolingParams("last", normalize=True),
              PoolingParams("cls", normalize=False, dimensions=8), PoolingParams("last", dimensions=64)]
    outs = run(engine, PROMPTS, params)
    for out, h, p in zip(outs, hidden_states, params):
        np.testing.assert_allclose(out.embedding, expected(h, p.method, p.normalize is not False, p.dimensions),
                                   rtol=1e-4, atol=1e-5)
    assert [len(o.embedding) for o in outs] == [24, 64, 8, 64]
    assert np.linalg.norm(outs[0].embedding) == pytest.approx(1.0, abs=1e-6)


def test_prefix_cache_hits_give_the_same_vectors(path, hidden_states):
    """Last-token pooling reuses cached blocks (its last token is always computed); mean pooling needs
    every prompt row, so it takes no hits and computes them again."""
    engine = llm(path)
    first = run(engine, [PROMPTS[3]], [PoolingParams("last", normalize=False)])[0]
    again = run(engine, [PROMPTS[3]] * 2, [PoolingParams("last", normalize=False), PoolingParams("mean", False)])
    assert first.num_cached_tokens == 0 and again[0].num_cached_tokens == 64 and again[1].num_cached_tokens == 0
    np.testing.assert_allclose(again[0].embedding, first.embedding, rtol=1e-5, atol=1e-5)  # another summation order
    np.testing.assert_allclose(again[1].embedding, expected(hidden_states[3], "mean", False), rtol=1e-4, atol=1e-4)
    assert all_blocks_free(engine)


def test_pooling_batched_beside_generation(path, hidden_states):
    """Generation requests and pooling requests in the same steps: the completions are what they are
    alone, the vectors what they are alone."""
    engine = llm(path, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    alone = run(engine, PROMPTS[1:3], [greedy] * 2)
    mixed = run(engine, [PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[0]],
                [greedy, PoolingParams("mean", normalize=False), greedy, PoolingParams("last", normalize=False)])
    assert [m.token_ids for m in (mixed[0], mixed[2])] == [a.token_ids for a in alone]
    assert mixed[0].embedding is None and len(mixed[0].token_ids) == 6
    np.testing.assert_allclose(mixed[1].embedding, expected(hidden_states[3], "mean", False), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mixed[3].embedding, expected(hidden_states[0], "last", False), rtol=1e-4, atol=1e-4)
    assert all_blocks_free(engine)


def test_an_aborted_pooling_request_frees_its_blocks(path):
    engine = llm(path, max_num_batched_tokens=16)
    req = make_request(PROMPTS[3], PoolingParams("mean"), model=engine._model, tokenizer=engine.tokenizer)
    engine.engine.add_request(req)
    engine.engine.step()  # a first chunk: its partial sum is held
    seq = engine.engine.requests[req.request_id][0]
    assert seq.pool_state is not None and not seq.is_finished
    engine.engine.abort(req.request_id)
    assert seq.pool_state is None and all_blocks_free(engine)


def test_each_runner_refuses_the_other_kind(path):
    gen = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, runner="generate")
    with pytest.raises(InvalidRequestError, match="served for generation: start with --runner pooling") as e:
        make_request("hi", PoolingParams(), model=gen._model, tokenizer=gen.tokenizer)
    assert e.value.field == "model"
    pool = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, runner="pooling")
    with pytest.raises(InvalidRequestError, match="served for pooling") as e:
        make_request("hi", SamplingParams(), model=pool._model, tokenizer=pool.tokenizer)
    assert e.value.field == "model"
    with pytest.raises(InvalidRequestError, match="at most the model's 64") as e:
        make_request("hi", PoolingParams(dimensions=65), model=pool._model, tokenizer=pool.tokenizer)
    assert e.value.field == "dimensions"
    # a pooling request may fill the context: no completion token follows
    n = pool.config.max_model_len
    full = make_request([7] * n, PoolingParams(), model=pool._model, tokenizer=pool.tokenizer)
    assert len(full.prompt_token_ids) == n
    with pytest.raises(InvalidRequestError, match=f"is {n + 1} tokens"):
        make_request([7] * (n + 1), PoolingParams(), model=pool._model, tokenizer=pool.tokenizer)
    kept = make_request([7] * (n + 5), PoolingParams(truncate_prompt_tokens=n), model=pool._model,
                        tokenizer=pool.tokenizer)
    assert len(kept.prompt_token_ids) == n


def test_a_preempted_pooling_request_pools_again_from_its_first_row(path):
    """4 blocks of 16 tokens: a decoding completion grows into the blocks a chunked mean-pooling prompt
    holds, so the pooling request (the newest) is preempted, its partial sum dropped, and it runs again
    once the completion has finished: its vector is still the mean over its whole prompt."""
    from transformers import AutoModel

    engine = LLM(path, dtype="float32", device="cpu", num_kv_blocks=4, block_size=16, max_num_batched_tokens=16,
                 runner="all", enable_prefix_caching=False)
    prompt = list(range(30, 90))
    gen, pooled = run(engine, [list(range(40, 55)), prompt],
                      [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), PoolingParams("mean", False)])
    assert engine.engine.stats().num_preemptions >= 1 and len(gen.token_ids) == 40
    with torch.no_grad():
        h = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([prompt])).last_hidden_state[0]
    np.testing.assert_allclose(pooled.embedding, expected(h, "mean", False), rtol=1e-4, atol=1e-4)
    assert all_blocks_free(engine)
