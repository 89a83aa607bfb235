"""The engine loop in its own process (what `pagoda serve` runs by default): the same streams as
the offline engine, refusals naming the field, aborts that free blocks, and a child that dies
failing its requests instead of hanging them."""
import asyncio
import os
import signal

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.engine_process import ProcessEngine
from engine.errors import EngineClosedError, EngineError, InvalidRequestError


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = ProcessEngine(EngineConfig(model=checkpoint("llama"), num_kv_blocks=64, max_queue_len=8))
    eng.start()
    yield eng
    eng.shutdown()


# the same check as for the in-process front, run here against this module's `engine` fixture
from test_async_engine import _collect, leave_a_stream, test_concurrent_streams_get_their_own_tokens  # noqa: E402,F401


def test_streams_equal_offline(engine, checkpoint):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=True, n=2)
    outs = asyncio.run(_collect(engine, "héllo wörld", params))
    offline = LLM(checkpoint("llama"), num_kv_blocks=64).generate(["héllo wörld"], params)[0]
    for i, choice in enumerate(offline.choices):
        mine = [o for o in outs if o.index == i]
        assert sum((o.token_ids for o in mine), []) == choice.token_ids
        assert "".join(o.text for o in mine) == choice.text
        assert mine[-1].finished and mine[-1].finish_reason == "length"
    assert engine.model_info.vocab_size == offline_vocab(checkpoint)
    assert engine.encode("hi") == engine.tokenizer.encode("hi")


def test_streams_decoded_in_the_parent_stop_where_the_engine_does(engine, checkpoint):
    # the child sends token ids; the parent's text must hold back a possible stop string, cut at a
    # found one as the engine does, and flush a finished stream's held-back bytes
    offline = LLM(checkpoint("llama"), num_kv_blocks=64)
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = offline.generate(["héllo wörld"], SamplingParams(**greedy))[0].text
    # a stop string across two tokens' text: its first character must be held back, not sent
    bounds = [len(offline.generate(["héllo wörld"], SamplingParams(**greedy | {"max_tokens": m}))[0].text)
              for m in range(4, 12)]
    stop = next(text[b - 1:b + 1] for b in bounds if 0 < b < len(text) and text.index(text[b - 1:b + 1]) == b - 1)
    reasons = []
    for params in (SamplingParams(**greedy, stop=[stop]), SamplingParams(**greedy, stop=["never-there"]),
                   SamplingParams(**greedy)):
        want = offline.generate(["héllo wörld"], params)[0]
        outs = asyncio.run(_collect(engine, "héllo wörld", params))
        got = "".join(o.text for o in outs)
        assert got == want.text and outs[-1].stop_reason == want.stop_reason
        reasons.append(want.stop_reason)
        assert sum((o.token_ids for o in outs), []) == want.token_ids
        assert (outs[-1].num_prompt_tokens, outs[-1].num_generated_tokens) == (want.num_prompt_tokens,
                                                                             want.num_generated_tokens)
        for i in range(1, len(outs)):  # no delta gave away text the stop string later cut
            assert "".join(o.text for o in outs[:i]) == got[:len("".join(o.text for o in outs[:i]))]
    assert reasons == ["stop_string", "length", "length"]


def offline_vocab(checkpoint):
    import transformers
    return transformers.AutoConfig.from_pretrained(checkpoint("llama")).vocab_size


def test_a_refused_request_names_the_field(engine):
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(_collect(engine, [1, 2, 99999], SamplingParams(max_tokens=4)))
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=10**6)))
    assert asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))[-1].finished


def test_leaving_a_stream_aborts_it_and_frees_its_blocks(engine):
    s = leave_a_stream(engine, tries=300)
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0


def test_a_dead_engine_process_fails_its_requests(checkpoint):
    eng = ProcessEngine(EngineConfig(model=checkpoint("llama"), num_kv_blocks=64))
    eng.start()

    async def main():
        gen = eng.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        await gen.__anext__()
        os.kill(eng._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process exited"):
            async for _ in gen:
                pass
        with pytest.raises(EngineClosedError):
            await _collect(eng, [1, 2], SamplingParams(max_tokens=2))
    asyncio.run(asyncio.wait_for(main(), 60))
    eng.shutdown()


def test_a_model_that_cannot_load_raises_in_the_parent(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="architecture 'llama' is not supported"):
        ProcessEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))  # the child's own exception
