"""server/convert.py without a server: defaults, validation messages, engine -> protobuf mapping."""
from types import SimpleNamespace

import grpc
import pytest

from pagoda.client.client import build_request
from pagoda.engine.errors import (DuplicateRequestError, EngineClosedError, EngineError, InvalidRequestError,
                                  QueueFullError)
from pagoda.engine.outputs import ModelInfo, RequestOutput, TokenLogprob
from pagoda.engine.inputs import make_request
from pagoda.engine.validation import ModelLimits
from pagoda.v1 import generation_pb2 as pb
from pagoda.server import convert
from pagoda.server.state import status_for

pytestmark = pytest.mark.timeout(60)

INFO = ModelInfo(model_id="m", architecture="LlamaForCausalLM", dtype="float32", max_model_len=512,
                 vocab_size=262, eos_token_ids=[257], block_size=16, num_kv_blocks=64, max_num_seqs=4,
                 max_num_batched_tokens=256, max_queue_len=8)
TOKENIZER = SimpleNamespace(encode=lambda text: list(text.encode()))


class Engine:
    """What convert needs of AsyncEngine: make_request (the engine's own validation) and the chat template."""
    model_info = INFO
    tokenizer = TOKENIZER

    def make_request(self, prompt, params, request_id=None, priority=0, **kw):
        return make_request(prompt, params, model=ModelLimits(INFO.vocab_size, INFO.max_model_len),
                            tokenizer=TOKENIZER, request_id=request_id, priority=priority, **kw)

    def apply_chat_template(self, msgs, tools=None, template_kwargs=None):
        return [258] + [b for m in msgs for b in m["content"].encode()]


ENGINE = Engine()


def convert_(prompt=None, **kw):
    return convert.to_engine_request(build_request(prompt, **kw), ENGINE)


def test_unset_fields_take_the_documented_defaults():
    r = convert_("Hello")
    p = r.params
    assert r.prompt_token_ids == list(b"Hello") and r.request_id and r.priority == 0
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.max_tokens == convert.DEFAULT_MAX_TOKENS == 256
    assert (p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (0, [], [], False)
    assert (p.logprobs, p.top_logprobs) == (False, 0)


def test_explicit_zeros_are_kept():
    p = convert_("Hello", temperature=0, top_k=0, min_p=0, seed=0, presence_penalty=0).params
    assert p.temperature == 0.0 and p.is_greedy and p.seed == 0


def test_default_max_tokens_is_capped_by_the_context():
    assert convert_([1] * 500).params.max_tokens == 12
    assert convert_([1] * 500, max_tokens=12).params.max_tokens == 12


def test_top_logprobs_implies_logprobs_and_ids_pass_through():
    r = convert_([1, 2], top_logprobs=3, request_id="r", priority=-2, stop=["x"], stop_token_ids=[5])
    assert r.params.logprobs and r.params.top_logprobs == 3
    assert (r.request_id, r.priority, r.params.stop, r.params.stop_token_ids) == ("r", -2, ["x"], [5])


def test_messages_use_the_chat_template():
    r = convert_(messages=[("user", "hi"), {"role": "assistant", "content": "yo"}])
    assert r.prompt_token_ids == [258, *b"hiyo"]


def test_error_messages_name_field_and_value():
    with pytest.raises(InvalidRequestError, match=r"^sampling\.top_p must be in \[0, 1\], got 1\.5$"):
        convert_("Hello", top_p=1.5)
    with pytest.raises(InvalidRequestError, match=r"^stopping\.max_tokens \(600\) plus the prompt \(5 tokens\)"):
        convert_("Hello", max_tokens=600)
    with pytest.raises(InvalidRequestError, match=r"^token_ids\.ids\[0\] must be a token id in \[0, 262\), got 262$"):
        convert_([262])
    with pytest.raises(InvalidRequestError, match=r"^stopping\.stop\[1\] must be a non-empty string"):
        convert_("Hello", stop=["a", ""])
    with pytest.raises(InvalidRequestError, match=r"^text is 600 tokens, more than the 511 prompt tokens"):
        convert_("x" * 600)


@pytest.mark.parametrize("stop_reason,expected", [
    ("length", pb.FINISH_REASON_LENGTH), ("stop_string", pb.FINISH_REASON_STOP_STRING),
    ("stop_token", pb.FINISH_REASON_STOP_TOKEN), ("eos", pb.FINISH_REASON_EOS), ("abort", pb.FINISH_REASON_ABORTED)])
def test_finish_reasons(stop_reason, expected):
    out = RequestOutput(request_id="r", token_ids=[1], text="a", finished=True, finish_reason="stop",
                        stop_reason=stop_reason, num_prompt_tokens=3, num_generated_tokens=4, num_cached_tokens=1,
                        logprobs=[TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.0)])])
    msg = convert.stream_response("r", out)
    assert msg.finish_reason == expected
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens) == (3, 4, 1)
    assert msg.logprobs[0].top_logprobs[1].token_id == 2


def test_unfinished_delta_has_no_finish_reason_or_usage():
    out = RequestOutput(request_id="r", token_ids=[1, 2], text="ab", num_prompt_tokens=3, num_generated_tokens=2)
    msg = convert.stream_response("r", out)
    assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not msg.HasField("usage")
    assert list(msg.token_ids) == [1, 2] and msg.text == "ab"


@pytest.mark.parametrize("exc,code", [
    (InvalidRequestError("text", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (convert.grpc_error(InvalidRequestError("max_tokens", "too many"), "text"), grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError("request_id", "'r' is already used by a request in flight"),
     grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineClosedError("closed"), grpc.StatusCode.UNAVAILABLE),
    (EngineError("boom"), grpc.StatusCode.INTERNAL),
    (KeyError("bug"), grpc.StatusCode.INTERNAL),
])
def test_status_codes(exc, code):
    got, message = status_for(exc)
    assert got == code and message
    if isinstance(exc, InvalidRequestError):
        assert message.startswith(exc.field)
