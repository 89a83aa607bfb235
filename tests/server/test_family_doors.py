"""The families beyond Llama's through every door: offline, gRPC and HTTP give transformers' own greedy
float32 tokens for a non-ASCII prompt (Gemma and Phi-3 with a SentencePiece tokenizer, as they ship; the
others with a byte-level BPE one), and the same text on each door."""
import httpx
import pytest

from conftest import FAMILIES, HYBRID
from grpc_fixtures import InProcessServer, openai_client
from oracle import greedy
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.server.options import ServerOptions
from sp_tokenizer import build_sentencepiece_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPT = "Über Öl — 東京で寿司 🎉"
SENTENCEPIECE = {"gemma2", "gemma3", "phi3"}
MAX_NEW = 16


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3", "mistral", "mixtral",
                                    "qwen2_moe", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe",
                                    "qwen3_next"])
def test_every_door_gives_transformers_tokens(family, tmp_path):
    path = str(tmp_path / family)
    tokenizer = build_sentencepiece_tokenizer(path) if family in SENTENCEPIECE else None
    build_tiny_checkpoint(path, tokenizer=tokenizer, **FAMILIES[family])
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    ids = llm.tokenizer.encode(PROMPT)
    want = greedy(path, [ids], MAX_NEW)[0]
    offline = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0]
    assert offline.prompt_token_ids == ids and offline.token_ids == want
    srv = InProcessServer.for_config(EngineConfig(dtype="float32", model=path, num_kv_blocks=64),
                                     ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            unary = c.generate(PROMPT, temperature=0, max_tokens=MAX_NEW)
            assert list(unary.token_ids) == want and unary.text == offline.text
            stats = c.stats()
            groups = [(g.window, g.num_layers, g.blocks_used) for g in stats.kv_groups]
            slots = (stats.state_slots_total, stats.state_slots_used)  # linear-attention states, all free again
        http = openai_client(srv).completions.create(model="m", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
        assert http.choices[0].text == offline.text
        # the KV figures per group of layers (a sliding and a full one for Gemma and gpt-oss), on both doors
        # (the hybrid models' attention layers: one in four)
        assert groups == ([(0, 1, 0), (16, 1, 0)] if family.startswith(("gemma", "gpt_oss")) else
                          [(0, 1, 0)] if family in HYBRID else
                          [(FAMILIES[family].get("sliding_window", 0), 2, 0)])
        http_stats = httpx.get(srv.http_url + "/stats").json()
        assert [tuple(g.values()) for g in http_stats["kv_groups"]] == groups
        assert slots == (http_stats["state_slots_total"], http_stats["state_slots_used"]) == (
            (256, 0) if family in HYBRID else (0, 0))
    finally:
        srv.stop()
