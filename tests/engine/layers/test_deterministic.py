"""Deterministic mode (engine/layers/deterministic.py): a probe request's tokens, logprobs and top logprobs
are bitwise the same alone, in batches of 2, 7 and 64 mixed requests, with prefill chunked at 16 tokens,
with its prefix from the cache and after preemptions (tests/deterministic_cases.py), for every family in
float32 and bfloat16, with two tensor-parallel ranks, through both doors and both transports. Without the
mode the same scenarios differ: the largest difference is printed (not a failure)."""
import concurrent.futures
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, HYBRID
from deterministic_cases import fillers, max_logprob_diff, probes, scenarios, signature
from grpc_fixtures import InProcessServer, openai_client
from oracle import greedy, random_prompts
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.layers import deterministic

pytestmark = pytest.mark.timeout(300)


def _torch_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN (torch's own reorder, not pagoda's code) packs `dtype` weights on this CPU: bfloat16
    needs AVX-512 (bw, vl, dq) or avx_ne_convert, and ONEDNN_MAX_CPU_ISA=AVX2 takes it away (AMD Zen 3)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        return True
    except RuntimeError:
        return False


REFUSAL = "deterministic mode: oneDNN cannot run bfloat16 linear layers on this CPU"


def _same_everywhere(results: dict):
    alone = results.pop("alone")
    for name, sigs in results.items():
        assert sigs == alone, f"{name}: max |logprob diff| {max(map(max_logprob_diff, alone, sigs))}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_probe_is_bitwise_the_same_in_every_batch(checkpoint, family, dtype):
    if family.startswith("gemma"):  # GeGLU has no batch-invariant kernel: refused by name
        with pytest.raises(ValueError, match="deterministic mode: the model's activation 'gelu_pytorch_tanh' has no "
                                             "batch-invariant kernel"):
            scenarios(checkpoint(family), deterministic=True, dtype=dtype)
        return
    if family in HYBRID:  # chunks of a prompt fall where the batch puts them: refused by name
        with pytest.raises(ValueError, match="deterministic mode: Qwen3.*'s linear-attention layers compute a "
                                             "prompt chunk by chunk"):
            scenarios(checkpoint(family), deterministic=True, dtype=dtype)
        return
    if family == "gpt_oss":  # its experts run on torch's GEMMs: refused by name
        with pytest.raises(ValueError, match="deterministic mode: gpt-oss's experts"):
            scenarios(checkpoint(family), deterministic=True, dtype=dtype)
        return
    if not _torch_packs(getattr(torch, dtype)):  # refused where oneDNN cannot: the refusal is the behaviour
        with pytest.raises(ValueError, match=REFUSAL):
            scenarios(checkpoint(family), deterministic=True, dtype=dtype)
        return
    _same_everywhere(scenarios(checkpoint(family), deterministic=True, dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_mode_the_difference_is_recorded(checkpoint, dtype, capsys):
    results = scenarios(checkpoint("llama"), dtype=dtype)
    alone = results.pop("alone")
    diffs = {name: max(map(max_logprob_diff, alone, sigs)) for name, sigs in results.items()}
    with capsys.disabled():
        print(f"\ndeterministic off, llama {dtype}: max |logprob diff| from alone: "
              + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert not any(math.isnan(d) for d in diffs.values())


def test_two_tensor_parallel_ranks(checkpoint):
    _same_everywhere(scenarios(checkpoint("qwen2"), batches=(7,), deterministic=True, tensor_parallel_size=2))


def _offline_alone(path: str, dtype: str) -> list:
    llm = LLM(path, deterministic=True, dtype=dtype, enable_prefix_caching=False)
    try:
        ps = probes(llm.engine.hf_config.vocab_size)
        return ps, [signature(llm.generate([p], [sp])[0]) for p, sp in ps], llm.engine.hf_config.vocab_size
    finally:
        llm.engine.close()


def _grpc_probe(c: Client, ids, sp) -> tuple:
    resp = c.generate(list(ids), temperature=sp.temperature, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos,
                      logprobs=True, top_logprobs=sp.top_logprobs)
    return list(resp.token_ids), [(t.token_id, t.logprob, tuple((u.token_id, u.logprob) for u in t.top_logprobs))
                                  for t in resp.logprobs]


def _filler_load(c: Client, vocab: int, n: int) -> list:
    """n filler requests over gRPC, concurrently (sampled ones unseeded: load only)."""
    pool = concurrent.futures.ThreadPoolExecutor(8)
    return [pool.submit(c.generate, list(ids), temperature=sp.temperature, max_tokens=sp.max_tokens,
                        ignore_eos=sp.ignore_eos) for ids, sp in fillers(vocab, n, seed=5)]


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_both_doors_give_the_offline_result(checkpoint, engine_process):
    path = checkpoint("llama")
    ps, offline, vocab = _offline_alone(path, "float32")
    (ids, sp), want = ps[0], offline[0]  # the greedy probe: tokens and top logprobs
    want_tokens = want[0][0]
    want_lps = [(t, lp, top) for t, lp, top, _ in want[0][1]]
    config = EngineConfig(model=path, deterministic=True, dtype="float32", engine_process=engine_process,
                          num_kv_blocks=128)
    from pagoda.server.options import ServerOptions
    srv = InProcessServer.for_config(config, ServerOptions(http_port=0)).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            assert c.model_info().deterministic
            assert _grpc_probe(c, ids, sp) == (want_tokens, want_lps)  # alone
            load = _filler_load(c, vocab, 24)
            assert _grpc_probe(c, ids, sp) == (want_tokens, want_lps)  # among the fillers
            oai = openai_client(srv)
            model = oai.models.list().data[0]
            assert model.model_extra["deterministic"] is True
            r = oai.completions.create(model=model.id, prompt=ids, max_tokens=sp.max_tokens, temperature=0,
                                       logprobs=sp.top_logprobs, extra_body={"ignore_eos": True})
            lp = r.choices[0].logprobs
            assert lp.token_logprobs == [x[1] for x in want_lps]
            # top logprobs are keyed by token text there (byte tokens may share one): each one of the offline's
            assert all(set(d.values()) <= {v for _, v in top} for d, (_, _, top) in zip(lp.top_logprobs, want_lps))
            for f in load:
                f.result(60)
    finally:
        srv.stop()


def test_linear_rows_alike_in_calls_of_any_size():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(96, 80, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
        if not _torch_packs(dtype):
            with pytest.raises(ValueError, match=REFUSAL):
                deterministic.BatchInvariantLinear(w, b)
            continue
        lin = deterministic.BatchInvariantLinear(w, b)
        x = torch.randn(700, 80, generator=g).to(dtype)
        full = lin(x)  # 256-row calls and a padded rest
        for m in (1, 2, 5, 7, 11, 13, 100, 255, 257, 513):
            assert torch.equal(lin(x[m // 3:m // 3 + m]), full[m // 3:m // 3 + m]), (dtype, m)
        assert deterministic.rows_agree(lin, 80, dtype, deterministic.BUCKETS)


def test_packed_linear_pads_rows_to_a_few_sizes():
    # oneDNN keeps a primitive per row count: a server's steps of every size up to its budget must map
    # to a few, and padding must not change a row's result or leak into the output's shape
    sizes = {deterministic.padded_rows(m) for m in range(deterministic.ONE_THREAD_ROWS + 1, 2049)}
    assert len(sizes) <= 64
    for m in range(1, 4097):
        p = deterministic.padded_rows(m)
        assert m <= p <= max(m + 3, m * 9 // 8), m
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    lin = deterministic.PackedLinear(w, b)
    x = torch.randn(300, 40, generator=g)
    for m in (1, 8, 9, 13, 33, 257, 300):
        y = lin(x[:m])
        assert y.shape == (m, 48)
        torch.testing.assert_close(y, torch.nn.functional.linear(x[:m], w, b), rtol=1e-5, atol=1e-5)


def test_attention_tokens_alike_as_prefill_or_decode():
    from pagoda.engine.layers.cpu_attention import cache_views, ops
    g = torch.Generator().manual_seed(0)
    n, kvh, heads, hd, bs = 40, 2, 4, 32, 16
    k_cache = torch.randn(4, bs, kvh, hd, generator=g)
    v_cache = torch.randn(4, bs, kvh, hd, generator=g)
    kc, vc = cache_views(k_cache, v_cache)
    q = torch.randn(n, heads, hd, generator=g)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    whole = ops().paged_attention(q, kc, vc, table, torch.tensor([0, n], dtype=torch.int32),
                                  torch.tensor([n], dtype=torch.int32), 0.2, True)
    for t in range(n):  # each token as a decode step over its context
        one = ops().paged_attention(q[t:t + 1], kc, vc, table, None, torch.tensor([t + 1], dtype=torch.int32),
                                    0.2, True)
        assert torch.equal(one[0], whole[t]), t


@pytest.mark.parametrize("options, message", [
    (dict(attention_backend="torch"), "attention_backend cpu"),
    (dict(quantization="int8"), "quantization 'int8'"),
    (dict(dtype="float16"), "float16"),
])
def test_what_the_mode_cannot_promise_is_refused(checkpoint, options, message):
    with pytest.raises(ValueError, match=f"deterministic mode: .*{message}"):
        LLM(checkpoint("llama"), deterministic=True, **options)


def test_cuda_and_other_activations_are_refused():
    with pytest.raises(ValueError, match="deterministic mode: it runs on CPU only"):
        deterministic.check(EngineConfig(deterministic=True), torch.device("cuda"))
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="activation 'gelu'"):
        deterministic.check(EngineConfig(deterministic=True), torch.device("cpu"),
                            GPT2Config(activation_function="gelu"), "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        EngineConfig(deterministic="yes")


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_greedy_output_still_matches_transformers(checkpoint, family):
    path = checkpoint(family)
    llm = LLM(path, deterministic=True, dtype="float32")
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [1, 15, 16, 17, 40, 3, 33, 70])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.token_ids for o in outs] == greedy(path, prompts, 12)


def test_serve_flag_and_environment(monkeypatch):
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config

    def parsed(*args):
        return engine_config(build_parser().parse_args(["serve", *args])).deterministic

    monkeypatch.delenv("PAGODA_DETERMINISTIC", raising=False)
    assert (parsed(), parsed("--deterministic"), parsed("--deterministic", "off")) == (False, True, False)
    monkeypatch.setenv("PAGODA_DETERMINISTIC", "on")
    assert parsed() is True
    with pytest.raises(SystemExit):
        parsed("--deterministic", "yes")


def test_bfloat16_without_avx512_is_refused(checkpoint):
    # oneDNN limited to AVX2 (as on a CPU without AVX-512) cannot pack bfloat16 weights
    code = ("from pagoda.engine import LLM\ntry:\n    LLM(%r, deterministic=True, dtype='bfloat16')\n"
            "except ValueError as e:\n    print(e)\n" % checkpoint("llama"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert REFUSAL in r.stdout, r.stderr[-2000:]
