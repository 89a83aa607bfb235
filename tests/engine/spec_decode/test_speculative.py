"""Speculative decoding (engine/spec_decode/): n-gram proposals verified by the target in one
forward. Greedy output is token-identical to no speculation and to transformers; sampled output
is distributed exactly as the target's; rejected proposals leave no KV block behind."""
import json
import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from conftest import FAMILIES, HYBRID
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.config import SpeculativeConfig
from pagoda.engine.demo import DEMO_CONFIG, build_tiny_checkpoint
from pagoda.engine.layers.sampler import Sampler, SamplingTensors
from pagoda.engine.spec_decode.acceptance import accepted_tokens
from pagoda.engine.spec_decode.proposers import NgramProposer
from sp_tokenizer import build_sentencepiece_tokenizer

pytestmark = pytest.mark.timeout(300)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "min_acceptance_rate": 0.0}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so the n-gram proposer has something to look up), and one
    that does not."""
    rng = random.Random(seed)
    out = []
    for n, times in ((5, 5), (9, 3), (14, 3), (3, 8)):
        base = [rng.randrange(vocab) for _ in range(n)]
        out.append(base * times)
    out.append([rng.randrange(vocab) for _ in range(23)])
    return out


def _reference(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuations, through EOS (the requests here ignore it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_new):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    return outs


class KnowingProposer:
    """A proposer that knows each prompt's greedy continuation and proposes it with one token in
    every few spoiled (so verification sees full, partial and no acceptance, in every position)."""

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]]):
        self.known = [(list(p), c) for p, c in zip(prompts, continuations)]
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        for prompt, cont in self.known:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                out = cont[done:done + k]
                spoil = self.calls % (k + 2)  # k or k + 1: nothing spoiled
                if spoil < len(out):
                    out[spoil] = (out[spoil] + 1) % 256
                return out
        return []


def _generate(path, prompts, params, spec=NGRAM, proposer=None, **options):
    llm = LLM(path, speculative_config=spec, **{"dtype": "float32", **options})
    if proposer is not None:
        llm.engine.speculator.proposer = proposer
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # rejected proposals' blocks given back
    assert llm.engine.speculator.num_proposed > 0
    return llm, outs


def _accepted_and_rejected(llm) -> None:
    s = llm.engine.speculator
    assert 0 < s.num_accepted < s.num_proposed, (s.num_proposed, s.num_accepted)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(HYBRID)))  # hybrid models: refused (test_hybrid_models)
def test_greedy_matches_transformers_and_no_speculation(checkpoint, family):
    path, prompts = checkpoint(family), _prompts(256)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _reference(path, prompts, max_new=40)
    # n-gram proposals (rarely right on random weights), then proposals mostly right
    llm, outs = _generate(path, prompts, greedy, num_kv_blocks=128)
    assert [o.token_ids for o in outs] == expected
    llm, outs = _generate(path, prompts, greedy, proposer=KnowingProposer(prompts, expected), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == expected
    _accepted_and_rejected(llm)
    # a mixed batch: penalties keep one sequence from speculating; the others do
    mixed = [greedy] * (len(prompts) - 1) + [SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.5)]
    plain = LLM(path, dtype="float32", num_kv_blocks=128).generate(prompts, mixed)
    llm, outs = _generate(path, prompts, mixed, proposer=KnowingProposer(prompts, expected), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.token_ids for o in outs[:-1]] == expected[:-1]
    _accepted_and_rejected(llm)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_greedy_ngram_with_prefix_caching_chunked_prefill_and_preemption(checkpoint, family, backend):
    path = checkpoint(family)
    shared = list(range(40, 72))  # two blocks every prompt shares (prefix cache hits)
    prompts = [shared + p for p in _prompts(256, seed=1)] * 2  # and each prompt twice
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=24, max_model_len=128,
                   attention_backend=backend)
    expected = _reference(path, prompts[:5], max_new=32) * 2
    for proposer in (None, KnowingProposer(prompts, expected)):
        llm, outs = _generate(path, prompts, params, spec={**NGRAM, "disable_by_batch_size": 64}, proposer=proposer,
                              **options)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.num_prompt_tokens_cached > 0
    _accepted_and_rejected(llm)


def test_greedy_with_triton_attention(checkpoint):
    # the Triton kernels' prefill-over-blocks path verifies the proposals (in Triton's interpreter on CPU)
    pytest.importorskip("triton")
    from pagoda.engine.layers import triton_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok, why = triton_attention.is_available(torch.device(device))
    if not ok:
        pytest.skip(why)
    path, prompts = checkpoint("llama"), _prompts(256)[:2]
    expected = _reference(path, prompts, max_new=12)
    llm, outs = _generate(path, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          proposer=KnowingProposer(prompts, expected), num_kv_blocks=32, attention_backend="triton",
                          device=device, dtype="float32")
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.runner.attention_backend_name == "triton_attention"
    _accepted_and_rejected(llm)


def test_greedy_with_tensor_parallelism(checkpoint):
    # two ranks (gloo): the verification's logits rows are the same collective calls on both
    path, prompts = checkpoint("qwen2"), _prompts(256)[:3]
    expected = _reference(path, prompts, max_new=16)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        llm.engine.speculator.proposer = KnowingProposer(prompts, expected)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
        _accepted_and_rejected(llm)
        stats = llm.engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.engine.close()


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def text_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    tokenizer = build_sentencepiece_tokenizer(path) if request.param == "sentencepiece" else None
    return build_tiny_checkpoint(path, "llama", initializer_range=0.3, tokenizer=tokenizer)


def test_stop_strings_logprobs_and_n_see_only_accepted_tokens(text_model):
    prompts = ["Über Öl und Größe, 寿司 🎉 " * 4, "The quick brown fox. " * 5]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=True, top_logprobs=2, n=2)
    plain = LLM(text_model, dtype="float32", num_kv_blocks=64).generate(prompts, params)
    # a stop string from the middle of each expected text, and one that never occurs
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 3] for o in plain]
    assert all(stops)
    knowing = KnowingProposer([o.prompt_token_ids for o in plain], [o.token_ids for o in plain])
    for prompt, stop in zip(prompts, stops):
        p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=True, top_logprobs=2, n=2,
                           stop=[stop, "never seen"])
        want = LLM(text_model, dtype="float32", num_kv_blocks=64).generate([prompt], p)[0]
        llm, (got,) = _generate(text_model, [prompt], p, proposer=knowing, num_kv_blocks=64)
        assert got.finish_reason == want.finish_reason == "stop" and got.stop_reason == "stop_string"
        _accepted_and_rejected(llm)
        for g, w in zip(got.outputs, want.outputs):
            assert (g.text, g.token_ids) == (w.text, w.token_ids)
            assert len(g.logprobs) == len(g.token_ids)
            assert [x.token_id for x in g.logprobs] == g.token_ids
            assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)
            assert [[t for t, _ in x.top] for x in g.logprobs] == [[t for t, _ in x.top] for x in w.logprobs]
    for proposer in (None, knowing):
        llm, outs = _generate(text_model, prompts, params, proposer=proposer, num_kv_blocks=64)
        for g, w in zip(outs, plain):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
            assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)
    _accepted_and_rejected(llm)


@pytest.fixture(scope="module")
def demo_shaped(tmp_path_factory):
    """The demo model's shape (hidden 256, head_dim 32): there, by default, a verification's logprobs differ
    from a decode step's in the last bits (checked when this test was written), so bitwise equality below
    is the deterministic mode's doing."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("demo-shaped")), "llama", initializer_range=0.05,
                                 printable_output=True, tie_word_embeddings=False, **DEMO_CONFIG)


def test_deterministic_mode_logprobs_bitwise_the_same_with_speculation(demo_shaped):
    # by default a verification row's logprobs agree with a plain decode step's to rounding (the test
    # above); with --deterministic every row's numbers are its own whatever the rows beside it, so
    # tokens, logprobs and top logprobs are bitwise those without speculation (greedy and seeded sampling)
    prompts = ["Über Öl und Größe, 寿司 🎉 " * 4, "The quick brown fox. " * 5]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=3)]
    options = dict(num_kv_blocks=64, deterministic=True)

    def numbers(outs):
        return [(c.token_ids, [(x.token_id, x.logprob, x.top) for x in c.logprobs]) for o in outs for c in o.outputs]

    for prompt in prompts:
        plain = LLM(demo_shaped, dtype="float32", **options).generate([prompt] * 2, params)
        knowing = KnowingProposer([o.prompt_token_ids for o in plain[:1]], [plain[0].outputs[0].token_ids])
        llm, outs = _generate(demo_shaped, [prompt] * 2, params, proposer=knowing, **options)
        _accepted_and_rejected(llm)
        assert numbers(outs) == numbers(plain)
        llm, outs = _generate(demo_shaped, [prompt] * 2, params, spec=_draft_spec(demo_shaped), **options)
        assert numbers(outs) == numbers(plain)


# ---- sampling: the output is distributed exactly as the target's ----

def _tensors(n, temperature, generators=()):
    return SamplingTensors(temperature=torch.full((n,), temperature), top_k=None, top_p=None, min_p=None,
                           is_greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False, generators=list(generators))


def test_acceptance_keeps_the_target_distribution():
    # Two positions per sequence: row 1 verifies proposal x = 2 against p1; row 2 (the target's next
    # distribution once x is accepted) gives the bonus token from p2. The joint outcome must be that of
    # rejection sampling: p1(t) for t != x (rejected: one token) and p1(x) * p2(y) for (x, y).
    V, x, n = 5, 2, 100_000
    p1 = torch.tensor([0.3, 0.1, 0.25, 0.15, 0.2])
    p2 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])
    logits = torch.stack([p1.log(), p2.log()]).repeat(n, 1)  # [2n, V]
    proposals = torch.tensor([x, -1]).repeat(n)
    tokens, _ = Sampler(seed=7, device=torch.device("cpu"))(logits, _tensors(2 * n, 1.0))
    rows = accepted_tokens(tokens, tokens == proposals, np.full(n, 2))
    assert {len(r) for r in rows} == {1, 2}
    counts = np.zeros(2 * V)  # outcome t (rejected, t != x) or V + y (accepted x, then y)
    for r in rows:
        counts[r[0] if len(r) == 1 else V + r[1]] += 1
    assert counts[x] == 0  # a rejected proposal is never the replacement
    rejected = p1.numpy().copy()
    rejected[x] = 0  # outcome x alone cannot happen
    expected = np.concatenate([rejected, p1[x].item() * p2.numpy()]).astype(np.float64)
    expected *= n / expected.sum()
    keep = expected > 0
    assert chisquare(counts[keep], expected[keep]).pvalue > 1e-3
    # the test's power: a 2% shift of mass between two outcomes is caught
    shifted = expected.copy()
    shifted[0] += 0.02 * n
    shifted[1] -= 0.02 * n
    assert chisquare(counts[keep], shifted[keep]).pvalue < 1e-6


@pytest.fixture(scope="module")
def sampling_model(checkpoint):
    return checkpoint("llama")


def test_first_tokens_distribution_unchanged_by_speculation(sampling_model):
    """The first generated tokens with and without speculation, two-sample chi-square (top_k 6 keeps the
    vocabulary tiny). The proposals are the prompt's greedy continuation, whatever was sampled: often
    the likeliest token, sometimes one outside the top 6, so acceptance and rejection both happen,
    at several positions per sequence."""
    path, n = sampling_model, 2000
    options = dict(num_kv_blocks=1024, max_num_seqs=256, seed=3)
    prompt = list(range(5, 45))
    greedy = _reference(path, [prompt], max_new=4)
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True)
    plain = LLM(path, dtype="float32", **options).generate([prompt] * n, params)
    llm, spec = _generate(path, [prompt] * n, params, spec={**NGRAM, "disable_by_batch_size": 256},
                          proposer=KnowingProposer([prompt], greedy), **options)
    _accepted_and_rejected(llm)
    for pos in (1, 2, 3):  # the first token is the prefill's; speculation starts with the second
        a = np.bincount([o.token_ids[pos] for o in plain], minlength=256)
        b = np.bincount([o.token_ids[pos] for o in spec], minlength=256)
        seen = (a + b) > 0
        assert chi2_contingency(np.stack([a[seen], b[seen]])).pvalue > 1e-3


def test_seeded_request_reproducible_with_speculation(sampling_model):
    # a seeded completion's draws are keyed by position: the same text with speculation as without,
    # alone or beside others
    prompt = _prompts(256)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=40, seed=11, ignore_eos=True, n=2)
    plain = LLM(sampling_model, dtype="float32", num_kv_blocks=64).generate([prompt], params)[0]
    expected = [c.token_ids for c in plain.outputs]
    assert expected[0] != expected[1]  # n > 1: each completion its own stream
    first = _generate(sampling_model, [prompt], params, proposer=KnowingProposer([prompt], [expected[0]]),
                      num_kv_blocks=64)[1][0]
    llm, outs = _generate(sampling_model, [prompt, _prompts(256)[1]], params, num_kv_blocks=64)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in outs[0].outputs] == expected
    assert first.text == plain.text


# ---- pieces ----

def test_ngram_proposer_proposes_what_followed_the_longest_suffix():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert p.propose([1, 2, 3, 4, 5, 7, 3, 8, 2, 3], 3) == [4, 5, 7]  # "2 3" beats the later "3"
    assert p.propose([7, 3, 8, 1, 1, 3], 2) == [8, 1]
    assert p.propose([1, 2, 3], 4) == []
    assert p.propose([5, 5, 5, 5, 5, 6, 5, 5, 5], 2) == [6, 5]  # the latest match with k tokens after it
    assert p.propose([5, 5, 5, 5], 2) == [5]  # else the latest
    assert p.propose([4], 2) == []


def test_ngram_proposer_matches_the_rule_spelled_out_on_random_text():
    """Against the rule written plainly: the longest n (max down to min) whose last n tokens occur earlier;
    of those occurrences the latest with k tokens after it, else the latest; what followed it."""
    def rule(ids, k, lo, hi):
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
            if starts:
                full = [s for s in starts if s + n + k <= len(ids)]
                s = (full or starts)[-1] + n
                return ids[s:s + k]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        ids = [rng.randrange(rng.choice([2, 3, 7])) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 5)
        p = NgramProposer(SpeculativeConfig(prompt_lookup_min=lo, prompt_lookup_max=hi))
        assert p.propose(ids, k) == rule(ids, k, lo, hi), (ids, k, lo, hi)


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be a positive integer"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"min_acceptance_rate": 2}, "min_acceptance_rate"),
    ({"k": 4}, "unknown key"),
    ({"method": "draft"}, "a draft model needs both"),
    ({"method": "ngram", "model": "/some/draft"}, "a draft model needs both"),
    ({"model": ""}, "model must be a checkpoint directory"),
    ("{not json", "not valid JSON"),
    ("[4]", "must be a JSON object"),
])
def test_bad_speculative_config_refused_naming_the_option(value, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineConfig(speculative_config=value)
    assert "speculative_config" in str(e.value) and "\n" not in str(e.value)


def test_draft_with_tensor_parallelism_refused():
    with pytest.raises(ValueError, match="speculative_config: a draft model is not supported with tensor_parallel"):
        EngineConfig(speculative_config={"model": "/some/draft"}, tensor_parallel_size=2)


def test_speculative_config_as_json_on_the_command_line_and_in_the_environment(capsys, monkeypatch):
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineConfig(speculative_config=json.dumps(spec)).speculative_config == SpeculativeConfig(**spec)
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
    assert engine_config(args).speculative_config == SpeculativeConfig(**spec)
    monkeypatch.delenv("PAGODA_SPECULATIVE_CONFIG", raising=False)
    assert engine_config(build_parser().parse_args(["serve"])).speculative_config is None
    monkeypatch.setenv("PAGODA_SPECULATIVE_CONFIG", json.dumps(spec))
    assert engine_config(build_parser().parse_args(["serve"])).speculative_config == SpeculativeConfig(**spec)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 0}'])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-config" in err and "num_speculative_tokens must be a positive integer" in err


# ---- the doors: the config reported, the counts in GetStats, /stats and Prometheus ----

def test_doors_report_the_config_and_the_counts():
    import httpx

    from grpc_fixtures import InProcessServer, engine_config, openai_client, tiny_checkpoint, wait_all_blocks_free
    from pagoda.client.client import Client
    from pagoda.server.options import ServerOptions

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    srv = InProcessServer.for_config(engine_config(tiny_checkpoint(), speculative_config=spec),
                                     ServerOptions(http_port=0)).wait_ready()
    try:
        prompt = "abc abd abe abc abd abe abc abd " * 3
        want = LLM(tiny_checkpoint(), dtype="float32", num_kv_blocks=64).generate(prompt, SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True))[0]
        with Client(srv.target, timeout=60) as c:
            info = c.model_info()
            assert json.loads(info.speculative_config) == {**json.loads(SpeculativeConfig().to_json()), **spec}
            got = c.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
            assert got.text == want.text
            model = info.model_id
            oai = openai_client(srv)
            out = oai.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
            assert out.choices[0].text == want.text
            card = oai.models.list().data[0]
            assert card.model_extra["speculative_config"]["num_speculative_tokens"] == 3
            stats = c.stats()
            assert stats.spec_proposed_tokens > 0 and 0 <= stats.spec_accepted_tokens <= stats.spec_proposed_tokens
            assert stats.spec_mean_accepted_length >= 1
            http = httpx.get(srv.http_url + "/stats").json()
            assert http["spec_proposed_tokens"] == stats.spec_proposed_tokens
            assert http["spec_mean_accepted_length"] == pytest.approx(stats.spec_mean_accepted_length)
            metrics = httpx.get(srv.http_url + "/metrics").text
            assert f"pagoda_spec_proposed_tokens_total {float(stats.spec_proposed_tokens)}" in metrics
            assert "pagoda_spec_accepted_tokens_total" in metrics and "pagoda_spec_mean_accepted_length" in metrics
            wait_all_blocks_free(c)
    finally:
        srv.stop()


# ---- switch-off rules ----

def _decode_step(seqs):
    from pagoda.engine.core.scheduler import SchedulerOutput

    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    return SchedulerOutput(list(seqs), [1] * len(seqs), [1] * len(seqs))


def _seqs(n):
    from pagoda.engine.core.sequence import Sequence

    params = SamplingParams(temperature=0, max_tokens=100)
    return [Sequence(str(i), [1, 2, 3, 1, 2, 3, 1, 2], params) for i in range(n)]


def test_no_speculation_in_a_step_with_more_sequences_than_disable_by_batch_size():
    from pagoda.engine.spec_decode.proposers import Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=3), max_model_len=512)
    assert spec.propose(_decode_step(_seqs(3))) == [[3, 1]] * 3
    assert spec.propose(_decode_step(_seqs(4))) is None


def test_a_sequence_with_poor_recent_acceptance_pauses_longer_each_time():
    from pagoda.engine.spec_decode.proposers import PAUSE_STEPS, Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, min_acceptance_rate=0.3), max_model_len=512)
    seqs = _seqs(2)

    def verify(results):
        sched = _decode_step(seqs)
        sched.spec_tokens = spec.propose(sched)
        assert sched.spec_tokens == [[3, 1], [3, 1]]
        spec.observe(sched, results)

    for pause in (2, 4, 8, PAUSE_STEPS, PAUSE_STEPS):  # doubled by each pause, up to PAUSE_STEPS
        for _ in range(2):  # seq 0 gets nothing accepted (1 -> 0.5 -> 0.25: below 0.3), seq 1 everything
            verify([[7], [3, 1, 2]])
        for _ in range(pause):
            assert spec.propose(_decode_step(seqs)) == [[], [3, 1]]
    verify([[3, 1, 2], [3, 1, 2]])  # tried again, and did well: the next pause is short again
    for _ in range(2):
        verify([[7], [3, 1, 2]])
    for _ in range(2):
        assert spec.propose(_decode_step(seqs)) == [[], [3, 1]]
    verify([[3, 7], [3, 1, 2]])
    assert (spec.num_proposed, spec.num_accepted, spec.num_verifications) == (56, 31, 28)
    assert spec.mean_accepted_length == 1 + 31 / 28


def test_structured_requests_do_not_speculate_beside_those_that_do(checkpoint):
    from pagoda.engine.structured.manager import StructuredOutputs

    path, prompts = checkpoint("llama"), _prompts(256)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[a-z]{3,20}"))]
    prompts = prompts[:4]
    plain = LLM(path, dtype="float32", num_kv_blocks=128).generate(prompts, params)
    expected = [o.token_ids for o in plain]
    llm, outs = _generate(path, prompts, params, proposer=KnowingProposer(prompts, expected), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == expected
    assert outs[3].text.isalpha() and outs[3].text.islower()
    _accepted_and_rejected(llm)


def test_rollback_gives_back_rejected_slots_and_caches_only_verified_tokens():
    from pagoda.engine.core.block_manager import BlockManager
    from pagoda.engine.core.scheduler import Scheduler
    from pagoda.engine.core.sequence import Sequence
    from pagoda.engine.outputs import FinishReason

    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    seq = Sequence("r", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=20))
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, [[7]])  # the prefill's token: 7 tokens, 6 computed
    out = sched.schedule()
    sched.add_proposals(out, [[8, 9, 10, 11]])
    assert out.num_new_tokens == [5] and out.num_sampled == [5] and len(seq.block_table) == 3  # 11 slots
    free = bm.num_free_blocks
    sched.update_from_output(out, [[99]])  # the first proposal rejected: the target's 99 instead
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 99] and seq.num_computed_tokens == 7
    assert len(seq.block_table) == 2 and bm.num_free_blocks == free + 1  # the third block is back
    assert seq.num_registered_blocks == 1  # block 2 (tokens 5..8) holds an uncomputed token: not cached
    out = sched.schedule()
    sched.add_proposals(out, [[8, 9, 10, 11]])
    sched.update_from_output(out, [[8, 9, 12]])  # two accepted, then the target's 12
    assert seq.token_ids[8:] == [8, 9, 12] and seq.num_computed_tokens == 10
    assert len(seq.block_table) == 3 and seq.num_registered_blocks == 2
    cached = {tuple(b.token_ids) for b in bm.blocks if b.hash is not None}
    assert cached == {(1, 2, 3, 4), (5, 6, 7, 99)}  # verified tokens only
    sched.finish(seq, FinishReason.ABORT)
    assert bm.num_free_blocks == 8


# ---- draft model ----

def _draft_spec(path: str, **more) -> dict:
    return {"model": path, "num_speculative_tokens": 3, "min_acceptance_rate": 0.0, **more}


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """draft(family) -> a smaller random checkpoint of the family, with the same tokenizer (one layer,
    two heads, other weights)."""
    built = {}

    def get(family: str) -> str:
        if family not in built:
            path = str(tmp_path_factory.mktemp(f"draft-{family}"))
            built[family] = build_tiny_checkpoint(path, **FAMILIES[family], seed=1, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1)
        return built[family]
    return get


def _all_accepted(llm) -> None:
    s = llm.engine.speculator
    assert 0 < s.num_accepted == s.num_proposed, (s.num_proposed, s.num_accepted)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_with_a_draft_matches_transformers_and_no_speculation(checkpoint, draft, family):
    path, prompts = checkpoint(family), _prompts(256)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _reference(path, prompts, max_new=30)
    assert [o.token_ids for o in LLM(path, dtype="float32", num_kv_blocks=128).generate(prompts, greedy)] == expected
    llm, outs = _generate(path, prompts, greedy, spec=_draft_spec(draft(family)), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.draft_runner.model is not llm.engine.model
    # a draft identical to the target proposes what the target chooses: every proposal accepted
    llm, outs = _generate(path, prompts, greedy, spec=_draft_spec(path), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == expected
    _all_accepted(llm)
    # a mixed batch: penalties keep one sequence from speculating (the draft does not run over its tokens)
    mixed = [greedy] * (len(prompts) - 1) + [SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5)]
    plain = LLM(path, dtype="float32", num_kv_blocks=128).generate(prompts, mixed)
    llm, outs = _generate(path, prompts, mixed, spec=_draft_spec(path), num_kv_blocks=128)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    _all_accepted(llm)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_with_a_draft_with_prefix_caching_chunked_prefill_and_preemption(checkpoint, draft, backend):
    # the draft's KV cache mirrors the target's blocks: prefix-cache hits, prompts computed in chunks and
    # recomputed after a preemption are complete in it too, so an identical draft still accepts everything
    path = checkpoint("llama")
    shared = list(range(40, 72))  # two blocks every prompt shares (prefix cache hits)
    prompts = [shared + p for p in _prompts(256, seed=1)] * 2
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=24, max_model_len=128,
                   attention_backend=backend)
    expected = _reference(path, prompts[:5], max_new=32) * 2
    for d in (draft("llama"), path):
        llm, outs = _generate(path, prompts, params, spec=_draft_spec(d, disable_by_batch_size=64), **options)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.num_prompt_tokens_cached > 0
    _all_accepted(llm)


def test_draft_with_steps_alternating_between_speculating_and_not(checkpoint, draft):
    # the draft runs only in steps that speculate (at most disable_by_batch_size sequences): two sequences
    # speculate, three more join (no speculation while five run), the short ones finish and the two speculate
    # again, the draft catching up over the tokens the target computed without it; then a prompt whose
    # blocks the target computed alone is a prefix-cache hit the draft recomputes. Token-identical, and an
    # identical draft still has every proposal accepted.
    from pagoda.engine.inputs import make_request

    path, prompts = checkpoint("llama"), _prompts(256, seed=2)
    expected = _reference(path, prompts, max_new=40)
    lengths, prompt_of = [40, 36, 8, 10, 12, 20], [0, 1, 2, 3, 4, 2]
    for d in (draft("llama"), path):
        llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=16, speculative_config=_draft_spec(d,
                disable_by_batch_size=2))
        engine, spec, steps, done = llm.engine, llm.engine.speculator, [], {}
        propose = spec.propose

        def logged(sched):  # steps: per step, whether it speculated
            out = propose(sched)
            steps.append(out is not None)
            return out
        spec.propose = logged

        def run(ids, num_steps=None):
            for i in ids:
                params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
                engine.add_request(make_request(prompts[prompt_of[i]], params, model=llm._model,
                                                tokenizer=llm.tokenizer, request_id=str(i), stream=False))
            while engine.has_work() and (num_steps is None or num_steps > 0):
                done.update({o.request_id: o.token_ids for o in engine.step()})
                # the draft's KV never runs ahead of the target's (rejected proposals' KV dropped)
                assert all(s.draft_computed <= s.num_computed_tokens for s in engine.scheduler.running)
                num_steps = None if num_steps is None else num_steps - 1
        run([0, 1], num_steps=3)
        run([2, 3, 4])
        cached = engine.scheduler.num_prompt_tokens_cached
        run([5])  # prompt 2 again: the target computed its blocks in steps the draft did not run
        assert engine.scheduler.num_prompt_tokens_cached > cached
        assert done == {str(i): expected[prompt_of[i]][:n] for i, n in enumerate(lengths)}
        flips = "".join("s" if x else "-" for x in steps)  # speculating, then not, then again
        assert "s-" in flips and "-s" in flips[flips.index("s-"):], flips
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    _all_accepted(llm)


def test_seeded_request_reproducible_with_a_draft(sampling_model, draft):
    prompt = _prompts(256)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=30, seed=11, ignore_eos=True, n=2)
    plain = LLM(sampling_model, dtype="float32", num_kv_blocks=64).generate([prompt], params)[0]
    expected = [c.token_ids for c in plain.outputs]
    for d in (sampling_model, draft("llama")):  # the target's argmax (sampled rows reject some), another model's
        llm, outs = _generate(sampling_model, [prompt, _prompts(256)[1]], params, spec=_draft_spec(d),
                              num_kv_blocks=64)
        assert [c.token_ids for c in outs[0].outputs] == expected
        if d == sampling_model:
            _accepted_and_rejected(llm)


def test_bad_draft_refused_at_start_in_one_line(checkpoint, tmp_path):
    other = build_tiny_checkpoint(str(tmp_path / "sp"), "llama", tokenizer=build_sentencepiece_tokenizer(str(tmp_path / "sp")))
    for d, message in ((other, "has another tokenizer than the target's"),
                       (str(tmp_path / "missing"), "draft model .* no such directory")):
        with pytest.raises(ValueError, match=message) as e:
            LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=16, speculative_config=_draft_spec(d))
        assert str(e.value).startswith("speculative_config: ") and "\n" not in str(e.value)
