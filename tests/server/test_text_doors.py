"""The same greedy request gives the same text through every door (offline LLM.generate, the
asyncio front over both transports, gRPC Generate and GenerateStream), for both kinds of tokenizer,
with prompts and completions in non-ASCII text, and that text is what the completion's bytes
spell: each character whole, U+FFFD only for bytes that form none. Tiny random models babble
byte tokens freely, so completions here hold characters cut short as well as whole ones."""
import asyncio

import pytest

from grpc_fixtures import InProcessServer
from pagoda.client.client import Client
from pagoda.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from sp_tokenizer import build_sentencepiece_tokenizer

PROMPTS = ["Sushi 🎉", "東京で", "Über Öl und Größe", "naïve résumé é"]


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    tokenizer = build_sentencepiece_tokenizer(path) if request.param == "sentencepiece" else None
    return build_tiny_checkpoint(path, "llama", initializer_range=0.3, tokenizer=tokenizer)


def token_bytes(tok, ids: list[int]) -> bytes:
    """What the tokens spell, read from their token strings (byte tokens <0xHH>, ▁ for a space;
    byte-level tokens through GPT-2's alphabet), independently of pagoda's decoder."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    out = b""
    for t in tok.convert_ids_to_tokens(ids):
        if t in special:
            continue
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            out += bytes([int(t[3:5], 16)])
        elif "▁" in t or "<0x41>" in tok.get_vocab():
            out += t.replace("▁", " ").encode()
        else:
            out += bytes(byte_of[c] for c in t)
    return out


def test_every_door_gives_the_text_the_bytes_spell(model):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    tok = llm.tokenizer
    offline = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, offline):
        spelled = token_bytes(tok, out.token_ids).decode("utf-8", "replace")
        assert out.text == spelled
        if "\ufffd" not in spelled:  # well-formed: exactly what transformers decodes
            ids = out.prompt_token_ids + out.token_ids
            assert out.text == tok.decode(ids, skip_special_tokens=True)[len(tok.decode(
                out.prompt_token_ids, skip_special_tokens=True)):]
    assert any(ord(c) > 127 for o in offline for c in o.text)

    for transport in ("thread", "process"):
        eng = AsyncEngine(EngineConfig(dtype="float32", model=model, num_kv_blocks=64,
                engine_process=transport == "process"))
        eng.start()
        try:
            streams = asyncio.run(_streams(eng, params))
        finally:
            eng.shutdown()
        for deltas, want in zip(streams, offline):
            assert "".join(deltas) == want.text, transport

    srv = InProcessServer.for_config(EngineConfig(dtype="float32", model=model, num_kv_blocks=64)).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            for prompt, want in zip(PROMPTS, offline):
                unary = c.generate(prompt, temperature=0, max_tokens=24, ignore_eos=True)
                streamed = "".join(p.text for p in c.generate_stream(prompt, temperature=0, max_tokens=24,
                                                                     ignore_eos=True))
                assert unary.text == streamed == want.text
                assert list(unary.token_ids) == want.token_ids
    finally:
        srv.stop()


async def _streams(eng, params):
    async def one(prompt):
        return [o.text async for o in eng.generate(prompt, params)]
    return await asyncio.gather(*[one(p) for p in PROMPTS])
