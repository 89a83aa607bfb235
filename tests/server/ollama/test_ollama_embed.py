"""Ollama's /api/embed and /api/embeddings (server/ollama/embed.py) on a tiny Qwen3-Embedding layout: the
vectors sentence-transformers gives, normalized; truncation; errors in Ollama's shape; the `ollama`
library's embed."""
import httpx
import numpy as np
import ollama
import pytest
from embedding_fixtures import MAX_SEQ_LENGTH, build_embedding_checkpoint
from grpc_fixtures import InProcessServer, engine_config

from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)
TEXTS = ["hello world", "Grüße aus Köln — 東京 🚀"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_embedding_checkpoint(str(tmp_path_factory.mktemp("qwen3-embedding")))


@pytest.fixture(scope="module")
def srv(path):
    s = InProcessServer.for_config(engine_config(path), ServerOptions(http_port=0)).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.http_url, timeout=60) as client:
        yield client


def test_the_ollama_librarys_embed(srv, path):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    got = ollama.Client(host=srv.http_url).embed(model=srv.engine.model_info.model_id, input=TEXTS)
    np.testing.assert_allclose(np.array(got.embeddings, dtype=np.float32), want, rtol=1e-4, atol=1e-5)


def test_embed_equals_sentence_transformers(http, srv, path):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    name = srv.engine.model_info.model_id
    body = http.post("/api/embed", json={"model": name + ":latest", "input": TEXTS}).json()
    np.testing.assert_allclose(np.array(body["embeddings"], dtype=np.float32), want, rtol=1e-4, atol=1e-5)
    assert body["model"] == name + ":latest"
    assert body["prompt_eval_count"] == sum(len(srv.engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    one = http.post("/api/embed", json={"model": name, "input": TEXTS[1], "dimensions": 8}).json()
    assert len(one["embeddings"]) == 1 and len(one["embeddings"][0]) == 8
    assert np.linalg.norm(one["embeddings"][0]) == pytest.approx(1.0, abs=1e-6)
    old = http.post("/api/embeddings", json={"model": name, "prompt": TEXTS[0]}).json()
    np.testing.assert_allclose(old["embedding"], want[0], rtol=1e-4, atol=1e-5)


def test_truncate(http, srv):
    name, long = srv.engine.model_info.model_id, "z" * (MAX_SEQ_LENGTH + 5)
    assert http.post("/api/embed", json={"model": name, "input": long}).json()["prompt_eval_count"] == MAX_SEQ_LENGTH
    refused = http.post("/api/embed", json={"model": name, "input": [long, "a"], "truncate": False})
    assert refused.status_code == 400 and "input[0]" in refused.json()["error"]
    empty = http.post("/api/embed", json={"model": name, "input": []})
    assert empty.status_code == 400 and "input must not be empty" in empty.json()["error"]
    assert http.post("/api/embed", json={"model": "nope", "input": "a"}).status_code == 404
