"""The request options both doors share, beyond sampling: prompt_logprobs (against transformers'
own log-softmax), echo, bad_words, and several prompts in one gRPC Generate call; each offline,
over gRPC and over HTTP (the `openai` client), with prefix caching, chunked prefill and preemption."""
import grpc
import openai
import pytest
import torch

from grpc_fixtures import InProcessServer, engine_config, openai_client, tiny_checkpoint, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.server.options import ServerOptions
from sp_tokenizer import build_sentencepiece_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(5, 45))  # 40 tokens: several prefill chunks of 16


@pytest.fixture(scope="module")
def srv():
    config = engine_config(tiny_checkpoint(), max_num_batched_tokens=16, block_size=4)
    s = InProcessServer.for_config(config, ServerOptions(http_port=0)).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(srv):
    return openai_client(srv)


@pytest.fixture(scope="module")
def reference():
    """Transformers' log-probabilities of each prompt token given the ones before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, vocab]: row i predicts ids[i + 1]
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logprobs


def check_prompt_logprobs(got, ids, lp, k):
    """`got`: (token id, logprob, [(id, logprob)] top) per prompt token after the first."""
    assert [g[0] for g in got] == ids[1:]
    for i, (tok, logprob, top) in enumerate(got):
        assert logprob == pytest.approx(lp[i, tok].item(), abs=1e-4)
        ref = lp[i].topk(k)
        assert [t for t, _ in top] == ref.indices.tolist()
        assert [p for _, p in top] == pytest.approx(ref.values.tolist(), abs=1e-4)


# ---- prompt_logprobs ----

@pytest.mark.parametrize("options", [dict(), dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)],
                         ids=["whole", "chunked-and-preempted"])
def test_offline_prompt_logprobs_match_transformers(reference, options):
    llm = LLM(tiny_checkpoint(), dtype="float32", **options)
    prompts = [PROMPT, PROMPT[:21], [7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3, n=2)
    outs = llm.generate(prompts, params)
    if options:
        assert llm.engine.scheduler.num_preemptions > 0  # recomputed prompts are not scored twice
    for ids, out in zip(prompts, outs):
        for choice in out.outputs:
            plp = choice.prompt_logprobs
            assert len(plp) == len(ids) and plp[0] is None
            if len(ids) > 1:
                check_prompt_logprobs([(x.token_id, x.logprob, x.top) for x in plp[1:]], ids, reference(ids), 3)
                ranks = reference(ids).argsort(-1, descending=True).argsort(-1)  # 0-based rank of every token
                assert [x.rank for x in plp[1:]] == [ranks[i, t].item() + 1 for i, t in enumerate(ids[1:])]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]  # scoring the prompt changes nothing
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(reference):
    llm = LLM(tiny_checkpoint(), dtype="float32", block_size=4)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs([(x.token_id, x.logprob, x.top) for x in out.prompt_logprobs[1:]], PROMPT,
                          reference(PROMPT), 0)
    again = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # and the scored prompt's blocks are cached for others


def test_grpc_prompt_logprobs_and_echo(client, reference):
    lp = reference(PROMPT)
    resp = client.generate(PROMPT, max_tokens=4, temperature=0, prompt_logprobs=2, echo=True, n=2)
    check_prompt_logprobs([(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top_logprobs])
                           for x in resp.prompt_logprobs], PROMPT, lp, 2)
    assert list(resp.prompt_token_ids) == PROMPT
    assert resp.prompt_text == LLM_TOKENIZER().decode(PROMPT)
    text = "Grüße, 東京"
    resp = client.generate(text, max_tokens=2, echo=True)
    assert resp.prompt_text == text and list(resp.prompt_token_ids) == list(client.tokenize(text))
    assert not resp.prompt_logprobs  # not asked for

    msgs = list(client.generate_stream(PROMPT, max_tokens=4, temperature=0, prompt_logprobs=2, echo=True, n=2))
    firsts = [m for m in msgs if m.prompt_logprobs]
    assert len(firsts) == 1 and firsts[0] is msgs[0]  # once, on the prompt's first message
    assert [x.logprob for x in firsts[0].prompt_logprobs] == [x.logprob for x in resp_plp(client)]
    assert list(msgs[0].prompt_token_ids) == PROMPT and msgs[0].prompt_text
    assert not any(m.prompt_token_ids for m in msgs[1:])


def resp_plp(client):
    return client.generate(PROMPT, max_tokens=1, prompt_logprobs=2).prompt_logprobs


def LLM_TOKENIZER():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint())


def test_http_echo_with_logprobs_and_prompt_logprobs(oai, reference):
    lp = reference(PROMPT)
    model = oai.models.list().data[0].id
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
                                 extra_body={"ignore_eos": True})
    c = out.choices[0]
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
    prompt_text = LLM_TOKENIZER().decode(PROMPT)
    assert c.text == prompt_text + plain.choices[0].text
    lps = c.logprobs
    assert len(lps.tokens) == len(PROMPT) + 4
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:len(PROMPT)] == pytest.approx([lp[i, t].item() for i, t in enumerate(PROMPT[1:])],
                                                              abs=1e-4)
    assert all(len(top) <= 2 for top in lps.top_logprobs[1:])
    assert lps.text_offset == sorted(lps.text_offset)

    streamed = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in streamed) == len(PROMPT) + 4

    chat_text = "Bonjour à tous"
    vllm = oai.completions.create(model=model, prompt=chat_text, max_tokens=2, extra_body={"prompt_logprobs": 1})
    plp = vllm.choices[0].model_extra["prompt_logprobs"]
    ids = LLM_TOKENIZER().encode(chat_text)
    assert plp[0] is None and len(plp) == len(ids)
    ref = reference(ids)
    for i, entry in enumerate(plp[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-4)
        best = ref[i].argmax().item()
        assert entry[str(best)]["rank"] == 1


def test_prompt_logprobs_out_of_range_is_refused_on_both_doors(client, oai):
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", prompt_logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=oai.models.list().data[0].id, prompt="hi", extra_body={"prompt_logprobs": -1})
    assert e.value.body["param"] == "prompt_logprobs"
    info = client.model_info().limits
    assert (info.max_prompt_logprobs, info.max_bad_words, info.max_logit_bias, info.max_n) == (20, 256, 1024, 64)


# ---- bad_words ----

def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def written_word(tok, gen: list[int]) -> str | None:
    """A word the completion wrote, as its tokens: one or two tokens that spell whole characters, and
    that tokenizing the word (alone or after a space) gives back."""
    for n in (2, 1):
        for i in range(len(gen) - n + 1):
            word = tok.decode(gen[i:i + n]).strip()
            if word and "\ufffd" not in word and any(
                    contains(gen, tok.encode(w, add_special_tokens=False)) for w in (word, " " + word)):
                return word
    return None


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def any_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    tokenizer = build_sentencepiece_tokenizer(path) if request.param == "sentencepiece" else None
    return build_tiny_checkpoint(path, "llama", initializer_range=0.3, tokenizer=tokenizer)


def test_bad_words_are_never_generated(any_model):
    llm = LLM(any_model, dtype="float32", num_kv_blocks=64)
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown", "Über Öl", "寿司", "fox jumps", "Привет", "naïve"]
    free = llm.generate(prompts, params)
    checked = 0
    for out in free:
        gen = out.token_ids
        word = written_word(tok, gen)
        if word is None:
            continue
        checked += 1
        banned = llm.generate([out.prompt_token_ids], params.replace(bad_words=[word]))[0]
        assert banned.token_ids != gen
        for spelling in (word, " " + word):
            ids = tok.encode(spelling, add_special_tokens=False)
            assert not contains(banned.token_ids, ids), (word, ids, banned.token_ids)
        # sampled too, and the ban leaves the rest of the distribution alone
        sampled = llm.generate([out.prompt_token_ids], params.replace(bad_words=[word], temperature=1.0, seed=3))[0]
        assert not contains(sampled.token_ids, tok.encode(word, add_special_tokens=False))
    assert checked >= 2


def test_bad_words_on_both_doors(client, oai):
    free = client.generate("Hello world", max_tokens=16, temperature=0, ignore_eos=True)
    word = LLM_TOKENIZER().decode(list(free.token_ids[:1]))
    ids = LLM_TOKENIZER().encode(word, add_special_tokens=False)
    g = client.generate("Hello world", max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
    h = oai.completions.create(model=oai.models.list().data[0].id, prompt="Hello world", max_tokens=16,
                               temperature=0, extra_body={"ignore_eos": True, "bad_words": [word],
                                                          "return_token_ids": True})
    assert list(g.token_ids) == h.choices[0].model_extra["token_ids"]
    assert not contains(list(g.token_ids), ids) and list(g.token_ids) != list(free.token_ids)
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", bad_words=["ok", "  "])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.bad_words[1]" in e.value.details()


# ---- several prompts in one Generate ----

def test_several_prompts_in_one_generate_call(client, srv):
    prompts = ["Hello", [5, 6, 7, 8], "東京で", "Hello"]
    kw = dict(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    resp = client.generate(prompts=prompts, request_id="batch", echo=True, **kw)
    assert len(resp.results) == len(prompts) and resp.request_id == "batch"
    assert not resp.text and not resp.choices
    for i, (prompt, r) in enumerate(zip(prompts, resp.results)):
        alone = client.generate(prompt, **kw)
        assert r.request_id == f"batch-{i}"
        assert [c.token_ids for c in r.choices] == [c.token_ids for c in alone.choices]
        assert r.text == alone.text and r.usage.completion_tokens == 12
        assert r.prompt_text == (prompt if isinstance(prompt, str) else LLM_TOKENIZER().decode(prompt))
    assert resp.usage.completion_tokens == 4 * 12
    assert resp.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in resp.results)

    msgs = list(client.generate_stream(prompts=prompts, request_id="s", **kw))
    for i, r in enumerate(resp.results):
        for c in r.choices:
            mine = [m for m in msgs if m.prompt_index == i and m.index == c.index]
            assert [t for m in mine for t in m.token_ids] == list(c.token_ids)
            assert "".join(m.text for m in mine) == c.text and mine[-1].finish_reason
            assert {m.request_id for m in mine} == {f"s-{i}"}
    wait_all_blocks_free(client)


def test_several_prompts_errors_name_the_prompt(client, srv):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompts=["ok", ""])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompts.prompts[1].text")
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompts=[[1, 2], [1, 10**6]])
    assert "prompts.prompts[1].token_ids.ids[1]" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompts=[])
    assert "prompts.prompts must hold at least one prompt" in e.value.details()
    assert srv.engine.num_in_flight == 0
    wait_all_blocks_free(client)


def test_a_refused_prompt_ends_the_whole_call_and_frees_the_others():
    """The queue holds 2 and one request waits in it: a call with 2 prompts is refused
    (RESOURCE_EXHAUSTED) and the one it had queued is aborted, not left running for nobody. A call
    with more prompts than the queue can ever hold is INVALID_ARGUMENT (retrying cannot help)."""
    import threading
    import time

    from grpc_fixtures import patched_run

    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), max_queue_len=2)).wait_ready()
    gate, entered = threading.Event(), threading.Event()

    def wrap(run):
        def held(*a, **kw):
            entered.set()
            gate.wait(30)
            return run(*a, **kw)
        return held
    try:
        with Client(s.target, timeout=60) as c, patched_run(s.engine, wrap):
            busy = c.generate_stream("x", max_tokens=2)
            first = threading.Thread(target=lambda: list(busy))
            first.start()
            assert entered.wait(30)  # the core is held inside a step: what comes now stays queued
            waiting = c.generate_stream("y", max_tokens=2)
            second = threading.Thread(target=lambda: list(waiting))
            second.start()
            deadline = time.monotonic() + 30
            while s.engine.num_queued() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompts=["a", "b"], max_tokens=2)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompts=["a", "b", "c"], max_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-queue-len" in e.value.details()
            gate.set()
            first.join(30)
            second.join(30)
            deadline = time.monotonic() + 30
            while s.engine.num_in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            assert s.engine.num_in_flight == 0
            wait_all_blocks_free(c)
            assert len(c.generate(prompts=["a", "b"], max_tokens=2).results) == 2
    finally:
        gate.set()
        s.stop()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing():
    """max_tokens 0 runs the prompt (in chunks here) and samples nothing: prompt logprobs as with
    max_tokens 1, no token, finish reason length, every block free; offline and over gRPC."""
    llm = LLM(tiny_checkpoint(), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, block_size=4)
    scored, one = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=0, prompt_logprobs=1),
                                                  SamplingParams(max_tokens=1, prompt_logprobs=1)])
    assert scored.token_ids == [] and scored.text == "" and scored.finish_reason == "length"
    assert scored.num_generated_tokens == 0 and len(one.token_ids) == 1
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(PROMPT)
    assert [lp.logprob for lp in scored.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in one.prompt_logprobs[1:]], abs=1e-4)
    assert llm.engine.stats().num_used_blocks == 0


def test_max_tokens_0_over_grpc(client):
    r = client.generate(PROMPT, max_tokens=0, prompt_logprobs=0)
    assert list(r.token_ids) == [] and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    assert len(r.prompt_logprobs) == len(PROMPT) - 1  # none for the first token
    wait_all_blocks_free(client)
