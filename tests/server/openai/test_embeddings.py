"""POST /v1/embeddings as the official `openai` client sees it: vectors equal sentence-transformers' for a
tiny Qwen3-Embedding layout, as floats and base64, for texts and token ids, with dimensions and truncation;
usage; OpenAI's errors; embeddings batched beside completions on a server that serves both; each runner
refusing the other kind of call."""
import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
from embedding_fixtures import MAX_SEQ_LENGTH, build_embedding_checkpoint
from grpc_fixtures import InProcessServer, engine_config, openai_client, tiny_checkpoint, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)
TEXTS = ["hello world", "Grüße aus Köln — 東京 🚀", "the quick brown fox jumps over the lazy dog; " * 3]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_embedding_checkpoint(str(tmp_path_factory.mktemp("qwen3-embedding")))


@pytest.fixture(scope="module")
def srv(path):
    s = InProcessServer.for_config(engine_config(path, max_num_batched_tokens=32), ServerOptions(http_port=0))
    yield s.wait_ready()
    s.stop()


@pytest.fixture(scope="module")
def oai(srv):
    """The client, every answer checked against OpenAI's specification: asked for floats (the client's own
    default is base64, which the specification does not describe)."""
    return openai_client(srv)


@pytest.fixture(scope="module")
def raw(srv):
    """The client as users run it, unchecked: it asks for base64 and decodes it."""
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)


def all_blocks_free(srv) -> None:
    with Client(srv.target, timeout=60) as c:
        wait_all_blocks_free(c)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def test_texts_equal_sentence_transformers(oai, raw, expected, srv):
    out = raw.embeddings.create(model=srv.engine.model_info.model_id, input=TEXTS)  # base64, decoded
    np.testing.assert_allclose(vectors(out), expected, rtol=1e-4, atol=1e-5)
    tokenizer = srv.engine.tokenizer
    n = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (n, n)
    floats = oai.embeddings.create(model=out.model, input=TEXTS[1], encoding_format="float")
    assert len(floats.data) == 1 and floats.data[0].index == 0
    np.testing.assert_allclose(floats.data[0].embedding, expected[1], rtol=1e-4, atol=1e-5)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    by_ids = oai.embeddings.create(model=out.model, input=ids, encoding_format="float")
    np.testing.assert_allclose(vectors(by_ids), expected, rtol=1e-4, atol=1e-5)
    one = oai.embeddings.create(model=out.model, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(vectors(one)[0], expected[0], rtol=1e-4, atol=1e-5)
    all_blocks_free(srv)


def test_base64_is_little_endian_float32(srv, expected):
    body = httpx.post(srv.http_url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, expected[0], rtol=1e-4, atol=1e-5)


def test_dimensions_truncate_then_renormalize(oai, expected):
    out = oai.embeddings.create(model=oai.models.list().data[0].id, input=TEXTS,
                                dimensions=16, encoding_format="float")
    v = vectors(out)
    want = expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1, keepdims=True)
    assert v.shape == (3, 16)
    np.testing.assert_allclose(v, want, rtol=1e-4, atol=1e-5)


def test_truncate_prompt_tokens(oai, srv):
    model = srv.engine.model_info.model_id
    long = "y" * (MAX_SEQ_LENGTH + 20)
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model=model, input=[TEXTS[0], long])
    assert e.value.body["param"] == "input[1]" and f"is {MAX_SEQ_LENGTH + 21} tokens" in e.value.body["message"]
    for keep in (MAX_SEQ_LENGTH, -1):  # -1: the model's length (vLLM's)
        out = oai.embeddings.create(model=model, input=long, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": keep})
        assert out.usage.prompt_tokens == MAX_SEQ_LENGTH


def test_errors(oai, srv):
    model = srv.engine.model_info.model_id
    for kw, param, words in (({"input": []}, "input", "must not be empty"),
                             ({"input": ""}, "input", "must not be empty"),
                             ({"input": TEXTS, "dimensions": 65}, "dimensions", "at most the model's 64"),
                             ({"input": [[1, 2, 9999]]}, "input[0][2]", "token id in [0, 263)"),
                             ({"input": "a", "extra_body": {"prompt_name": "passage"}}, "prompt_name", "query")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.embeddings.create(model=model, **kw)
        assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="no-such-model", input="a")


def test_a_pooling_server_refuses_generation(oai, srv):
    model = srv.engine.model_info.model_id
    with pytest.raises(openai.BadRequestError, match="served for pooling"):
        oai.completions.create(model=model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="served for pooling") as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["param"] == "model"


def test_a_generation_server_refuses_embeddings():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint()), ServerOptions(http_port=0)).wait_ready()
    try:
        with pytest.raises(openai.BadRequestError, match="served for generation: start with --runner pooling") as e:
            openai_client(s).embeddings.create(model=s.engine.model_info.model_id, input="hi")
        assert e.value.body["param"] == "model"
    finally:
        s.stop()


def test_embeddings_beside_completions_on_one_server(path, expected):
    """runner all: both doors open; concurrent calls share the engine's steps, and each answer is what it is alone."""
    s = InProcessServer.for_config(engine_config(path, runner="all", max_num_batched_tokens=32),
                                   ServerOptions(http_port=0)).wait_ready()
    try:
        client = openai_client(s)
        model = s.engine.model_info.model_id
        alone = client.completions.create(model=model, prompt=TEXTS[2], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            gens = [pool.submit(client.completions.create, model=model, prompt=TEXTS[2], max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True}) for _ in range(2)]
            embs = [pool.submit(client.embeddings.create, model=model, input=TEXTS, encoding_format="float")
                    for _ in range(2)]
            for f in gens:
                assert f.result().choices[0].text == alone.choices[0].text
            for f in embs:
                np.testing.assert_allclose(vectors(f.result()), expected, rtol=1e-4, atol=1e-5)
        all_blocks_free(s)
    finally:
        s.stop()


def test_pooling_requests_and_tokens_in_stats_and_metrics(oai, srv):
    before = httpx.get(srv.http_url + "/stats").json()
    out = oai.embeddings.create(model=srv.engine.model_info.model_id, input=TEXTS, encoding_format="float")
    after = httpx.get(srv.http_url + "/stats").json()
    assert after["pooling_requests"] - before["pooling_requests"] == len(TEXTS)
    assert after["pooling_tokens"] - before["pooling_tokens"] == out.usage.prompt_tokens
    assert after["generated_tokens"] == before["generated_tokens"]
    metrics = httpx.get(srv.http_url + "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("pagoda_pooling_"))
    assert float(lines["pagoda_pooling_requests_total"]) == after["pooling_requests"]
    assert float(lines["pagoda_pooling_tokens_total"]) == after["pooling_tokens"]


def test_score_and_rerank_are_cosines_of_the_embeddings(srv, expected):
    """vLLM's /v1/score and /v1/rerank over a bi-encoder: the cosine of the two texts' normalized vectors."""
    cos = expected @ expected.T  # sentence-transformers' vectors are normalized (its Normalize module)
    one = httpx.post(srv.http_url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60).json()
    assert [d["index"] for d in one["data"]] == [0, 1, 2] and one["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in one["data"]], cos[0], rtol=1e-4, atol=1e-5)
    pairs = httpx.post(srv.http_url + "/v1/score", json={"text_1": TEXTS, "text_2": TEXTS[::-1]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [cos[0, 2], cos[1, 1], cos[2, 0]], rtol=1e-4,
                               atol=1e-5)
    ranked = httpx.post(srv.http_url + "/v1/rerank", json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2},
                        timeout=60).json()
    order = np.argsort(-cos[1])[:2]
    assert [r["index"] for r in ranked["results"]] == order.tolist() and ranked["results"][0]["index"] == 1
    assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], cos[1][order], rtol=1e-4, atol=1e-5)
    for path, body, param in (("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_2"),
                              ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                              ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "", "documents": ["b"]}, "query")):
        r = httpx.post(srv.http_url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    all_blocks_free(srv)


RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_causal_lm_served_as_a_cross_encoder_reranker(tmp_path):
    """Qwen3-Reranker's recipe, as vLLM serves it: the client writes the prompt template into the query and
    documents; the score is softmax(logits of "no", "yes") at the pair's last position, P(yes) — equal to
    transformers' own causal LM's."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.engine.demo import build_byte_tokenizer, build_tiny_checkpoint

    tokenizer = build_byte_tokenizer(unk_token="<|endoftext|>")
    tokenizer.add_tokens(["yes", "no"])
    path = build_tiny_checkpoint(str(tmp_path / "reranker"), "qwen3", tokenizer=tokenizer, initializer_range=0.3)
    query = (f"{RERANK_PREFIX}<Instruct>: Given a web search query, retrieve relevant passages\n"
             f"<Query>: capital of France?\n")
    docs = [f"<Document>: {d}{RERANK_SUFFIX}" for d in ("Paris is the capital.", "Bananas are yellow.", "Köln 東京")]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for d in docs:
            logits = model(torch.tensor([tokenizer(query, d)["input_ids"]])).logits[0, -1]
            want.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
    config = engine_config(path, runner="pooling", pooling='{"classifier_from_token": ["no", "yes"]}',
                           max_num_batched_tokens=32)
    s = InProcessServer.for_config(config, ServerOptions(http_port=0)).wait_ready()
    try:
        scored = httpx.post(s.http_url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
        np.testing.assert_allclose([d["score"] for d in scored["data"]], want, rtol=1e-4, atol=1e-6)
        ranked = httpx.post(s.http_url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
        assert [r["index"] for r in ranked["results"]] == np.argsort(-np.array(want)).tolist()
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], sorted(want, reverse=True),
                                   rtol=1e-4, atol=1e-6)
        import grpc

        from pagoda.v1 import generation_pb2 as pb
        from pagoda.v1 import generation_pb2_grpc as pb_grpc
        with grpc.insecure_channel(s.target) as channel:  # the gRPC contract's Rerank: the same scores
            out = pb_grpc.GenerationServiceStub(channel).Rerank(pb.RerankRequest(query=query, documents=docs, top_n=2),
                                                                timeout=60)
        assert [r.index for r in out.results] == np.argsort(-np.array(want)).tolist()[:2]
        np.testing.assert_allclose([r.relevance_score for r in out.results], sorted(want, reverse=True)[:2],
                                   rtol=1e-4, atol=1e-6)
        all_blocks_free(s)
    finally:
        s.stop()
