"""The Embed RPC: the vectors POST /v1/embeddings gives (sentence-transformers' for a tiny Qwen3-Embedding
layout), for texts and token ids, with dimensions and a prompt; INVALID_ARGUMENT naming the field; GetStats
counting pooling requests; a generation server refusing it."""
import grpc
import numpy as np
import pytest
from embedding_fixtures import build_embedding_checkpoint
from grpc_fixtures import InProcessServer, engine_config, tiny_checkpoint

from pagoda.server.options import ServerOptions
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)
TEXTS = ["hello world", "Grüße aus Köln — 東京 🚀"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_embedding_checkpoint(str(tmp_path_factory.mktemp("qwen3-embedding")))


@pytest.fixture(scope="module")
def srv(path):
    s = InProcessServer.for_config(engine_config(path), ServerOptions()).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def st_encode(path, texts, **kw):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True, **kw)


def vectors(response) -> np.ndarray:
    return np.array([list(e.values) for e in response.embeddings], dtype=np.float32)


def test_embed_equals_sentence_transformers(stub, srv, path):
    want = st_encode(path, TEXTS)
    out = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS]), timeout=60)
    np.testing.assert_allclose(vectors(out), want, rtol=1e-4, atol=1e-5)
    ids = [srv.engine.tokenizer(t)["input_ids"] for t in TEXTS]
    assert [e.prompt_tokens for e in out.embeddings] == [len(i) for i in ids]
    assert out.prompt_tokens == sum(map(len, ids))
    by_ids = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=i)) for i in ids]), timeout=60)
    np.testing.assert_allclose(vectors(by_ids), want, rtol=1e-4, atol=1e-5)
    query = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS], prompt_name="query",
                                       dimensions=16), timeout=60)
    full = st_encode(path, TEXTS, prompt_name="query")[:, :16]
    np.testing.assert_allclose(vectors(query), full / np.linalg.norm(full, axis=1, keepdims=True), rtol=1e-4, atol=1e-5)
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=60)
    assert stats.pooling_requests == 6 and stats.generated_tokens == 0
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    assert (info.runner, info.hidden_size) == ("pooling", vectors(out).shape[1])
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("request_,field", [
    (pb.EmbedRequest(), "inputs"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a"), pb.EmbedInput(text="")]), "inputs[1].text"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=[1, 9999]))]), "inputs[0].token_ids.ids[1]"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=65), "dimensions"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput()]), "inputs[0]"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], prompt_name="passage"), "prompt_name"),
])
def test_embed_refusals_name_the_field(stub, request_, field):
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(request_, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + " ")


def test_a_generation_server_refuses_embed():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint()), ServerOptions()).wait_ready()
    try:
        with grpc.insecure_channel(s.target) as channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(channel).Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")]), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "served for generation: start with --runner pooling" in e.value.details()
    finally:
        s.stop()


def test_rerank_as_a_bi_encoder_is_the_cosine_of_the_embeddings(stub, path):
    query, docs = "Grüße aus Köln", ["Köln liegt am Rhein", "東京 🚀", "hello world"]
    vecs = st_encode(path, [query] + docs)
    want = vecs[1:] @ vecs[0]  # normalized: cosines
    out = stub.Rerank(pb.RerankRequest(query=query, documents=docs), timeout=60)
    assert [r.index for r in out.results] == np.argsort(-want).tolist()
    np.testing.assert_allclose([r.relevance_score for r in out.results], np.sort(want)[::-1], rtol=1e-4, atol=1e-5)
    assert out.prompt_tokens > 0
    top = stub.Rerank(pb.RerankRequest(query=query, documents=docs, top_n=1), timeout=60)
    assert [r.index for r in top.results] == [int(np.argmax(want))]
    with pytest.raises(grpc.RpcError) as e:
        stub.Rerank(pb.RerankRequest(query=query), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("documents ")
