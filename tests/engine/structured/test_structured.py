"""Structured outputs (engine/structured/manager.py, llguidance): with tiny random-weight models, which never
write JSON unconstrained, every completion that finishes with `stop` parses and validates against
its JSON schema (the `jsonschema` package), full-matches its regex or is one of its choices; greedy
and sampled, n > 1, constrained and free sequences in one batch, both tokenizer kinds. Greedy
constrained output is the same whatever shares the batch, with prefix caching on or off, after
preemption and over both transports. Bad constraints are INVALID_ARGUMENT / 400 naming the field,
and a slow compile does not hold up the other requests."""
import asyncio
import json
import random
import re
import threading
import time

import grpc
import jsonschema
import openai
import pytest
import torch

from grpc_fixtures import InProcessServer, engine_config, openai_client, slow_steps, tiny_checkpoint, \
    wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.structured.manager import StructuredOutputs
from pagoda.server.options import ServerOptions
from sp_tokenizer import build_sentencepiece_tokenizer
from structured_cases import CHOICES, GRAMMAR, REGEXES, SCHEMAS

pytestmark = pytest.mark.timeout(600)

def check(so: StructuredOutputs, text: str) -> None:
    """A completion that finished with `stop` matches its constraint."""
    if so.json is not None:
        jsonschema.validate(json.loads(text), json.loads(so.json))
    elif so.json_object:
        assert isinstance(json.loads(text), dict)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), (so.regex, text)
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"[1-9][0-9]{0,2}([-+*][1-9][0-9]{0,2})*", text), text


def constraints() -> list[StructuredOutputs]:
    return ([StructuredOutputs(json=s) for s in SCHEMAS] + [StructuredOutputs(json_object=True)]
            + [StructuredOutputs(regex=r) for r in REGEXES] + [StructuredOutputs(choice=c) for c in CHOICES]
            + [StructuredOutputs(grammar=GRAMMAR)])


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    tokenizer = build_sentencepiece_tokenizer(path) if request.param == "sentencepiece" else None
    return build_tiny_checkpoint(path, "llama", initializer_range=0.3, tokenizer=tokenizer)


def test_every_constrained_output_matches_its_constraint(model):
    """Per tokenizer: 20 constraints x (greedy + 3 seeds x n=2) = 140 constrained completions, in one
    batch with free ones."""
    llm = LLM(model, dtype="float32", num_kv_blocks=512, max_num_seqs=256)
    prompts, params, kinds = [], [], []
    rnd = random.Random(0)
    for so in constraints():
        for seed in (None, 1, 2, 3):
            prompts.append(rnd.choice(["Hello", "Write JSON:", "東京 🎉", "Q: "]))
            sampled = dict(temperature=1.0, seed=seed, n=2) if seed else dict(temperature=0.0)
            params.append(SamplingParams(max_tokens=96, structured_outputs=so, **sampled))
            kinds.append(so)
    for i in range(12):  # free sequences in the same batch
        prompts.append("Hello")
        params.append(SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=i))
        kinds.append(None)
    outs = llm.generate(prompts, params)
    done = 0
    for so, out in zip(kinds, outs):
        for c in out.outputs:
            if so is None:
                continue
            if c.finish_reason == "stop":
                check(so, c.text)
                done += 1
            else:
                assert c.finish_reason == "length" and c.num_generated_tokens == 96
    total = sum(len(o.outputs) for so, o in zip(kinds, outs) if so is not None)
    assert total == 140 and done >= 0.85 * total, (done, total)
    assert llm.engine.block_manager.num_free_blocks == llm.config.num_kv_blocks


def test_the_constraint_decides_where_the_completion_ends(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64)
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=50, structured_outputs=StructuredOutputs(
        regex=r"[0-9]{3}")))[0]
    assert re.fullmatch(r"[0-9]{3}", out.text) and out.finish_reason == "stop"
    assert out.stop_reason in ("grammar", "eos")
    # max_tokens still applies (the structure may be left unfinished: documented), and stop strings
    short = llm.generate("x", SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputs(
        json=SCHEMAS[0])))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3 and short.text.startswith('{"')
    stopped = llm.generate("x", SamplingParams(temperature=0, max_tokens=20, stop=[";"],
                                               structured_outputs=StructuredOutputs(choice=["ab;cd"])))[0]
    assert stopped.text == "ab" and stopped.stop_reason == "stop_string"
    # min_tokens cannot push a completion past its grammar's end: the grammar wins
    forced = llm.generate("x", SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                                              structured_outputs=StructuredOutputs(choice=["ok"])))[0]
    assert forced.text == "ok"


def _greedy(llm, so_list, extra=(), repeat=1):
    prompts = ["Hello", "東京", "Q: x", "Write", "Hi"][:len(so_list)] * repeat
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so in so_list] * repeat
    outs = llm.generate(prompts + [e[0] for e in extra], params + [e[1] for e in extra])
    return [o.token_ids for o in outs[:len(prompts)]]


def test_greedy_constrained_output_is_the_same_whatever_else_runs(checkpoint):
    sos = [StructuredOutputs(json=SCHEMAS[i]) for i in (0, 1, 3, 6)] + [StructuredOutputs(regex=REGEXES[0])]
    base = _greedy(LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=256), sos)
    others = [("Hello", SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                                       structured_outputs=StructuredOutputs(json_object=True) if i % 2 else None))
              for i in range(8)]
    assert _greedy(LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=256), sos, others) == base
    no_cache = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert _greedy(no_cache, sos, repeat=2) == base + base
    tight = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    assert _greedy(tight, sos, others) == base
    assert tight.engine.scheduler.num_preemptions > 0


def test_both_transports_and_the_triton_backend(checkpoint):
    so = StructuredOutputs(json=SCHEMAS[0])
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    want = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64).generate("Hello", params)[0].token_ids
    triton = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64, attention_backend="triton")
    assert triton.generate("Hello", params)[0].token_ids == want

    async def run(process: bool):
        engine = AsyncEngine(EngineConfig(dtype="float32", model=checkpoint("llama"), num_kv_blocks=64,
                engine_process=process))
        engine.start()
        try:
            ids = []
            async for out in engine.generate("Hello", params):
                ids += out.token_ids
            return ids
        finally:
            engine.shutdown()
    assert asyncio.run(run(False)) == want
    assert asyncio.run(run(True)) == want


def test_bad_constraints_name_the_option():
    for kw, field in [(dict(), "structured_outputs"), (dict(regex="a", choice=["b"]), "structured_outputs"),
                      (dict(choice=[]), "structured_outputs.choice"), (dict(choice=["a", ""]),
                                                                        "structured_outputs.choice[1]"),
                      (dict(json_object=False), "structured_outputs")]:
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutputs(**kw)
        assert e.value.field == field
    llm = LLM(tiny_checkpoint(), dtype="float32", num_kv_blocks=32)
    for so, field, words in [(StructuredOutputs(json="{nope"), "structured_outputs.json", "not valid JSON"),
                             (StructuredOutputs(json={"type": "foo"}), "structured_outputs.json", "invalid"),
                             (StructuredOutputs(regex="(ab"), "structured_outputs.regex", "invalid"),
                             (StructuredOutputs(grammar="start: foo"), "structured_outputs.grammar", "invalid")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate("x", SamplingParams(structured_outputs=so))
        assert e.value.field == field and words in str(e.value)


# ---- the doors ----

@pytest.fixture(scope="module")
def srv():
    options = ServerOptions(http_port=0, max_grammar_bytes=1_000_000, grammar_compile_timeout=30)
    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=256), options).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(srv):
    return openai_client(srv)


def test_grpc_structured_output(client):
    from pagoda.v1 import generation_pb2 as pb

    for schema in SCHEMAS[:4]:
        req = pb.GenerateRequest(text="Hello", structured_output=pb.StructuredOutput(json_schema=json.dumps(schema)))
        req.sampling.temperature = 0.0
        req.stopping.max_tokens = 96
        resp = client.stub.Generate(req, timeout=60)
        assert resp.finish_reason in (pb.FINISH_REASON_GRAMMAR, pb.FINISH_REASON_EOS)
        jsonschema.validate(json.loads(resp.text), schema)
        stream = pb.GenerateStreamRequest.FromString(req.SerializeToString())
        assert "".join(m.text for m in client.stub.GenerateStream(stream, timeout=60)) == resp.text
    req = pb.GenerateRequest(text="Hi", structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["a", "b"])))
    req.sampling.n = 4
    assert {c.text for c in client.stub.Generate(req, timeout=60).choices} <= {"a", "b"}
    info = client.model_info().limits
    assert info.max_grammar_bytes == 1_000_000 and info.grammar_compile_timeout_seconds == 30


@pytest.mark.parametrize("so,field", [
    (dict(json_schema="{nope"), "structured_output.json_schema"),
    (dict(json_schema='{"type": "foo"}'), "structured_output.json_schema"),
    (dict(regex="(ab"), "structured_output.regex"),
    (dict(grammar="start: foo"), "structured_output.grammar"),
    (dict(json_object=False), "structured_output.json_object"),
    (dict(choice={"choices": ["a", ""]}), "structured_output.choice.choices[1]"),
    (dict(), "structured_output"),
])
def test_grpc_bad_constraint_is_invalid_argument(client, so, field):
    from pagoda.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(text="Hello", structured_output=pb.StructuredOutput(**so))
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + " ")


def big_enum(n: int) -> dict:
    rnd = random.Random(n)
    return {"enum": ["".join(rnd.choice("abcdefghij") for _ in range(12)) for _ in range(n)]}


def slow_schema(n: int) -> dict:
    """~0.5 MB of schema that takes llguidance ~0.4 s to compile (2 idle cores)."""
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": [f"k{i}_0"],
                       "properties": {f"k{i}_{j}": {"type": "string", "pattern": f"^[a-z]{{{j + 1}}}$"}
                                      for j in range(30)}} for i in range(n)]}


def test_oversize_constraint_is_refused(client):
    from pagoda.v1 import generation_pb2 as pb

    huge = pb.GenerateRequest(text="x", structured_output=pb.StructuredOutput(json_schema=json.dumps(big_enum(80_000))))
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(huge, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("structured_output.json_schema is ")
    assert "more than the 1000000 accepted (--max-grammar-bytes)" in e.value.details()


def test_a_slow_compile_does_not_hold_up_other_streams(srv, client):
    from pagoda.v1 import generation_pb2 as pb

    stamps = []

    def stream():
        for _ in client.generate_stream("Hello", max_tokens=400, ignore_eos=True, temperature=0):
            stamps.append(time.monotonic())
    with slow_steps(srv.engine, 0.005):
        t = threading.Thread(target=stream)
        t.start()
        while not stamps:
            time.sleep(0.01)
        slow = pb.GenerateRequest(text="x", structured_output=pb.StructuredOutput(
            json_schema=json.dumps(slow_schema(300))))
        slow.stopping.max_tokens = 4
        t0 = time.monotonic()
        resp = client.stub.Generate(slow, timeout=60)
        t1 = time.monotonic()
        t.join(60)
    assert resp.usage.completion_tokens >= 1
    during = sum(t0 <= s <= t1 for s in stamps)
    assert during >= 3, (during, t1 - t0)  # the stream kept going while the schema compiled
    wait_all_blocks_free(client)


def test_a_compile_past_the_time_limit_is_refused():
    from pagoda.v1 import generation_pb2 as pb

    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=64), ServerOptions(
        max_grammar_bytes=1_000_000, grammar_compile_timeout=0.02)).wait_ready()
    try:
        with Client(s.target, timeout=60) as c:
            slow = pb.GenerateRequest(text="x", structured_output=pb.StructuredOutput(
                json_schema=json.dumps(slow_schema(299))))
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Generate(slow, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("structured_output.json_schema did not compile within 0.02s "
                                                "(--grammar-compile-timeout)")
            assert c.generate("Hello", max_tokens=4).usage.completion_tokens >= 1  # serving on
            fine = c.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)
            assert fine.finish_reason
    finally:
        s.stop()


def test_http_response_format_and_vllm_names(oai):
    model = oai.models.list().data[0].id
    schema = SCHEMAS[3]
    out = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "status?"}],
                                      temperature=0, max_tokens=96, response_format={
                                          "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    obj = oai.completions.create(model=model, prompt="x", max_tokens=96, temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
    c = obj.choices[0]
    assert isinstance(json.loads(c.text), dict) if c.finish_reason == "stop" else c.text.startswith("{")
    for body, check_text in [({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
                             ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
                             ({"guided_choice": ["東京"]}, lambda t: t == "東京"),
                             ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(r"[0-9+*-]+", t))]:
        r = oai.completions.create(model=model, prompt="x", max_tokens=40, temperature=0, extra_body=body)
        assert check_text(r.choices[0].text), (body, r.choices[0].text)
    chunks = list(oai.completions.create(model=model, prompt="x", max_tokens=96, temperature=0, stream=True,
                                         extra_body={"guided_json": SCHEMAS[0]}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), SCHEMAS[0])


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_http_bad_constraint_is_a_400_naming_it(oai, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=oai.models.list().data[0].id, prompt="x", max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_the_manager_advances_and_rolls_back_a_sequences_matcher(checkpoint):
    """StructuredOutputManager on its own (byte-level tokenizer: token 97 is "a"): a sequence waits for
    its grammar's template, gets its own matcher, whose bitmask allows what the grammar allows next;
    accepted tokens advance it, rollback undoes them, the grammar's end finishes the sequence."""
    from pagoda.engine.loader import load_hf_config, load_tokenizer
    from pagoda.engine.core.sequence import Sequence
    from pagoda.engine.outputs import FinishReason
    from pagoda.engine.structured.manager import StructuredOutputManager

    path = checkpoint("llama")
    manager = StructuredOutputManager(load_tokenizer(path), load_hf_config(path).vocab_size, [2])
    grammar = manager.compiler.compile(StructuredOutputs(choice=["abc", "abd"]))
    seq = Sequence("r", [5, 6], SamplingParams(max_tokens=8))
    manager.add([seq], grammar)
    assert manager.num_waiting == 1
    ready, failed = [], []
    for _ in range(500):
        ready, failed = manager.take_ready()
        if ready or failed:
            break
        manager.wait(0.01)
    assert ready == [seq] and failed == [] and manager.num_waiting == 0 and seq.matcher is not None

    def allowed() -> set[int]:
        rows, bits = manager.bitmasks([seq])
        assert rows == [0]
        return {w * 32 + j for w, word in enumerate(bits[0].tolist()) for j in range(32) if word >> j & 1}

    a, b, c, d = 97, 98, 99, 100
    assert allowed() == {a}
    assert manager.accept(seq, a) == (None, None) and manager.accept(seq, b) == (None, None)
    assert allowed() == {c, d}
    assert manager.accept(seq, c) == (FinishReason.GRAMMAR, None)  # "abc": nothing more is allowed
    manager.rollback(seq, 2)  # back to "a"
    assert allowed() == {b}
    manager.accept(seq, b)
    assert manager.accept(seq, d) == (FinishReason.GRAMMAR, None)
    manager.rollback(seq, 1)
    assert allowed() == {c, d}
    reason, error = manager.accept(seq, a)  # the mask never allows this: an error that says why
    assert reason is FinishReason.ERROR and error.startswith("structured output:")
    manager.close()


def test_masks_begun_at_the_steps_start_are_the_ones_the_sampler_gets(checkpoint):
    """start_bitmasks fills a step's masks on a thread (while the model runs); bitmasks joins them for
    that very list of sequences, and for any other list joins them first, then fills its own."""
    from pagoda.engine.loader import load_hf_config, load_tokenizer
    from pagoda.engine.core.sequence import Sequence
    from pagoda.engine.structured.manager import StructuredOutputManager

    path = checkpoint("llama")
    manager = StructuredOutputManager(load_tokenizer(path), load_hf_config(path).vocab_size, [2])
    try:
        grammar = manager.compiler.compile(StructuredOutputs(choice=["abc", "bcd"]))
        seqs = [Sequence(f"r{i}", [5, 6], SamplingParams(max_tokens=8)) for i in range(3)]
        manager.add(seqs[:2], grammar)
        while manager.num_waiting:
            manager.wait(0.01)
            manager.take_ready()
        manager.accept(seqs[1], 98)  # "b": the two constrained rows differ
        step = [seqs[2], seqs[0], seqs[1]]  # row 0 free
        serial = manager.bitmasks(step)
        manager.start_bitmasks(step)
        assert manager.pending is not None
        rows, bits = manager.bitmasks(step)
        assert manager.pending is None and rows == serial[0] == [1, 2] and torch.equal(bits, serial[1])
        manager.start_bitmasks(step)
        other = manager.bitmasks(seqs[:1])  # another list: the begun masks are joined, not taken
        assert manager.pending is None and other[0] == [0] and torch.equal(other[1], serial[1][:1])
        manager.start_bitmasks([seqs[2]])  # nothing constrained: nothing begun
        assert manager.pending is None and manager.bitmasks([seqs[2]]) is None
    finally:
        manager.close()


@pytest.mark.parametrize("trigger", ["", 3, "\ud800"])
def test_a_bad_trigger_names_the_field(trigger):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputs(grammar="start: /[0-9]+/", trigger=trigger)
    assert e.value.field == "structured_outputs.trigger"
