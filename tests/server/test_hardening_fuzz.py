"""Fuzzed input against a live in-process server (hypothesis): every request field within and beyond
its bounds (NaN and infinities, huge integers, giant repeated fields, long and odd Unicode stop
strings, unknown field numbers and wire types, bytes that are not UTF-8 in string fields, oversized
messages). Every answer must be OK or a documented status code with a message naming the field; the
server must stay SERVING with every KV block free afterwards.

Protobuf strings must be UTF-8, so non-UTF-8 bytes go out through a hand-encoded message on a raw
channel. The request messages hold no enum field; the client's handling of unknown enum values in
responses (a newer server's FinishReason) is checked at the end.
"""
from __future__ import annotations

import collections
import math
import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.client.client import Client
from hardening_fixtures import running, server_idle, wait_all_blocks_free
from pagoda.v1 import generation_pb2 as pb
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(400)

C = grpc.StatusCode
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}
FIELDS = ("text ", "token_ids", "messages", "prompt ", "sampling.", "stopping.", "request_id ", "top_logprobs ",
          "request is not a valid", "x-request-id")
MAX_MESSAGE_BYTES = 64 * 1024  # small, so oversized messages are cheap to make
MAX_TOKENS = 6  # --max-tokens-limit of the fuzzed server: keeps every generation short
STRUCTURED_EXAMPLES = 2000
RAW_EXAMPLES = 1000

SEEN: collections.Counter = collections.Counter()  # status code name -> answers (figures for the notes)


@pytest.fixture(scope="module")
def srv():
    opts = ServerOptions(max_message_bytes=MAX_MESSAGE_BYTES, max_tokens_limit=MAX_TOKENS, request_timeout=60)
    with running(opts, num_kv_blocks=128, max_num_seqs=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


def check_answer(code, details, kind):
    SEEN[code.name] += 1
    assert code in DOCUMENTED, f"{kind}: undocumented status {code.name}: {details}"
    if code != C.OK:
        assert details, f"{kind}: {code.name} without a message"
    if code == C.INVALID_ARGUMENT:
        assert details.startswith(FIELDS), f"{kind}: message does not name the field: {details!r}"


def call(client, req, stream: bool, metadata=None):
    """Sends req (GenerateRequest fields) as Generate or GenerateStream; returns (code, details, response)."""
    try:
        if stream:
            sreq = pb.GenerateStreamRequest.FromString(req.SerializeToString())
            msgs = list(client.stub.GenerateStream(sreq, timeout=60, metadata=metadata))
            return C.OK, "", msgs
        return C.OK, "", client.stub.Generate(req, timeout=60, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


def check_ok(req, resp, stream: bool):
    """A successful answer keeps to the request's bounds."""
    if stream:
        assert resp and resp[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        by_index = collections.defaultdict(int)
        for m in resp:
            by_index[m.index] += len(m.token_ids)
        counts = list(by_index.values())
    else:
        assert resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        counts = [len(c.token_ids) for c in resp.choices]
        assert len(resp.choices) == (req.sampling.n if req.sampling.HasField("n") else 1)
    limit = req.stopping.max_tokens if req.stopping.HasField("max_tokens") else MAX_TOKENS
    assert all(n <= limit for n in counts), (counts, limit)


# ---- structured requests ----

U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-2**31, 2**31 - 1)
U64 = st.integers(0, 2**64 - 1)
DOUBLES = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e-320, 1e308, math.nan, math.inf, -math.inf]))
TEXT = st.one_of(st.text(max_size=40), st.text(st.characters(codec="utf-8"), max_size=400),
                 st.sampled_from(["", "\x00", "\U0001F600" * 50, "e\u0301" * 30, "\ufeff", "\u202e", "\r\n"]))
TOKEN_IDS = st.one_of(
    st.lists(st.integers(0, 270), max_size=24),
    st.lists(st.one_of(st.integers(0, 261), U32), max_size=8),
    st.builds(lambda n, v: [v] * n, st.integers(0, 4000), st.integers(0, 261)),  # long and giant prompts
)
STOPS = st.one_of(
    st.lists(TEXT, max_size=20),
    st.builds(lambda k, s: [s] * k, st.integers(0, 40), st.text(min_size=200, max_size=300)),
)


def _opt(strategy):
    return st.one_of(st.none(), strategy)


# Per field: (within bounds, anything the wire allows).
TAME_TEXT = st.text(min_size=1, max_size=40)
FIELDS_SAMPLING = {
    "temperature": (st.floats(0, 2), DOUBLES),
    "top_p": (st.floats(0.01, 1), DOUBLES),
    "min_p": (st.floats(0, 1), DOUBLES),
    "repetition_penalty": (st.floats(0.5, 2), DOUBLES),
    "presence_penalty": (st.floats(-2, 2), DOUBLES),
    "frequency_penalty": (st.floats(-2, 2), DOUBLES),
    "top_k": (st.integers(-1, 300), st.one_of(st.integers(-3, 300), I32)),
    "seed": (st.integers(0, 2**63 - 1), st.one_of(st.integers(0, 10), U64)),
    "n": (st.integers(1, 4), st.one_of(st.integers(0, 4), U32)),
}
MAX_TOKENS_S = (st.integers(1, MAX_TOKENS), st.one_of(st.integers(0, MAX_TOKENS + 1), U32))
MIN_TOKENS_S = (st.integers(0, 2), st.one_of(st.integers(0, MAX_TOKENS + 1), U32))
STOPS_S = (st.lists(st.text(min_size=1, max_size=20), max_size=16), STOPS)
STOP_IDS_S = (st.lists(st.integers(0, 261), max_size=10),
              st.one_of(st.lists(st.integers(0, 270), max_size=10),
                        st.builds(lambda n, v: [v] * n, st.integers(0, 5000), U32)))
TOP_LOGPROBS_S = (st.integers(0, 20), st.one_of(st.integers(0, 22), U32))
REQUEST_ID_S = (st.text(max_size=12), st.one_of(st.just(""), st.text(max_size=12), st.text(min_size=250, max_size=270)))
PROMPT_KIND_S = (st.sampled_from(["text", "token_ids", "messages"]),
                 st.sampled_from(["text", "token_ids", "messages"] * 4 + ["none", "huge"]))


@st.composite
def requests(draw):
    """A GenerateRequest; mode "tame" keeps every field within bounds, "wild" draws each from anything
    the wire allows, "mixed" tosses a coin per field."""
    mode = draw(st.sampled_from(["tame", "mixed", "wild"]))

    def pick(pair):
        wild = mode == "wild" or (mode == "mixed" and draw(st.booleans()))
        return draw(pair[1] if wild else pair[0])

    req = pb.GenerateRequest()
    req.request_id = pick(REQUEST_ID_S)
    kind = pick(PROMPT_KIND_S)
    tame = mode == "tame"
    if kind == "text":
        req.text = draw(TAME_TEXT if tame else TEXT)
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 261), min_size=1, max_size=300) if tame else TOKEN_IDS))
    elif kind == "messages":
        req.messages.SetInParent()
        roles = st.sampled_from(["user", "system", "assistant"] + ([] if tame else ["", "tool"]))
        for role, content in draw(st.lists(st.tuples(roles, TAME_TEXT if tame else TEXT),
                                           min_size=1 if tame else 0, max_size=6)):
            req.messages.messages.add(role=role, content=content)
    elif kind == "huge":  # past --max-message-bytes
        req.text = "x" * draw(st.integers(MAX_MESSAGE_BYTES - 16, 2 * MAX_MESSAGE_BYTES))
    for name, pair in FIELDS_SAMPLING.items():
        v = draw(_opt(st.just(None))) if draw(st.booleans()) else pick(pair)
        if v is not None:
            setattr(req.sampling, name, v)
    t = req.stopping
    if draw(st.booleans()):
        t.max_tokens = pick(MAX_TOKENS_S)
    if draw(st.booleans()):
        t.min_tokens = pick(MIN_TOKENS_S)
    t.stop.extend(pick(STOPS_S))
    t.stop_token_ids.extend(pick(STOP_IDS_S))
    t.ignore_eos = draw(st.booleans())
    req.logprobs = draw(st.booleans())
    if draw(st.booleans()):
        req.top_logprobs = pick(TOP_LOGPROBS_S)
    req.priority = draw(I32)
    return req


FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                     suppress_health_check=list(HealthCheck))


@settings(max_examples=STRUCTURED_EXAMPLES, **FUZZ_SETTINGS)
@given(req=requests(), stream=st.booleans(),
       request_id_md=_opt(st.text(string.ascii_letters + string.digits + "-_.:", max_size=300)))
def test_fuzzed_requests_get_documented_answers(srv, client, req, stream, request_id_md):
    metadata = (("x-request-id", request_id_md),) if request_id_md is not None else None
    code, details, resp = call(client, req, stream, metadata)
    check_answer(code, details, f"{'GenerateStream' if stream else 'Generate'}({str(req)[:300]!r})")
    if code == C.OK:
        check_ok(req, resp, stream)


# ---- hand-encoded bytes: bad UTF-8, unknown fields and wire types, garbage ----

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    tag = _varint(number << 3 | wire)
    if wire == 0:
        return tag + _varint(payload)
    if wire == 1:
        return tag + bytes(payload)[:8].ljust(8, b"\0")
    if wire == 5:
        return tag + bytes(payload)[:4].ljust(4, b"\0")
    return tag + _varint(len(payload)) + payload  # wire 2


NOT_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc", b"ok\xe2\x82",
                            b"\xc0\xaf", b"\xfe\xfe\xff\xff"])
BYTES_OR_BAD = st.one_of(st.binary(max_size=30), NOT_UTF8, st.builds(lambda a, b: a + b, st.binary(max_size=10),
                                                                       NOT_UTF8))


@st.composite
def raw_messages(draw):
    """Serialized GenerateRequest-like bytes: valid pieces mixed with broken ones."""
    parts = [_field(2, 2, b"Hello")] if draw(st.booleans()) else []
    parts.append(_field(6, 2, _field(1, 0, draw(st.integers(1, 3)))))  # stopping.max_tokens
    for _ in range(draw(st.integers(0, 5))):
        which = draw(st.sampled_from(["bad_text", "bad_id", "bad_stop", "bad_chat", "unknown", "wrong_wire",
                                      "garbage", "deep"]))
        if which == "bad_text":
            parts.append(_field(2, 2, draw(BYTES_OR_BAD)))
        elif which == "bad_id":
            parts.append(_field(1, 2, draw(BYTES_OR_BAD)))
        elif which == "bad_stop":
            parts.append(_field(6, 2, _field(3, 2, draw(BYTES_OR_BAD))))
        elif which == "bad_chat":
            msg = _field(1, 2, draw(BYTES_OR_BAD)) + _field(2, 2, draw(BYTES_OR_BAD))
            parts.append(_field(4, 2, _field(1, 2, msg)))
        elif which == "unknown":
            wire = draw(st.sampled_from([0, 1, 2, 5]))
            parts.append(_field(draw(st.integers(10, 536870911)), wire,
                                draw(U64) if wire == 0 else draw(st.binary(max_size=20))))
        elif which == "wrong_wire":  # a known field number with another wire type
            number = draw(st.sampled_from([1, 2, 3, 5, 6, 7, 8, 9]))
            wire = draw(st.sampled_from([0, 1, 2, 5]))
            parts.append(_field(number, wire, draw(U64) if wire == 0 else draw(st.binary(max_size=12))))
        elif which == "deep":  # nesting deeper than the parser's recursion limit
            inner = b""
            for _ in range(draw(st.integers(90, 140))):
                inner = _field(6, 2, inner)
            parts.append(inner)
        else:
            parts.append(draw(st.binary(max_size=40)))
    order = draw(st.permutations(parts))
    return b"".join(order)


@settings(max_examples=RAW_EXAMPLES, **FUZZ_SETTINGS)
@given(data=raw_messages(), stream=st.booleans())
def test_hand_encoded_bytes_get_documented_answers(srv, data, stream):
    channel = RAW[srv.target]
    method = "/pagoda.v1.GenerationService/" + ("GenerateStream" if stream else "Generate")
    try:
        if stream:
            list(channel.unary_stream(method)(data, timeout=60))
        else:
            channel.unary_unary(method)(data, timeout=60)
        code, details = C.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    check_answer(code, details, f"raw {method} {data[:80]!r}")


class _RawChannels(dict):
    def __missing__(self, target):
        self[target] = grpc.insecure_channel(target)
        return self[target]


RAW = _RawChannels()


def test_not_utf8_is_invalid_argument_not_internal(srv):
    """The lenient deserializer: grpc's default answers INTERNAL "Exception deserializing request!"."""
    ch = RAW[srv.target]
    for method in ("Generate", "GenerateStream", "Tokenize"):
        fn = (ch.unary_stream if method == "GenerateStream" else ch.unary_unary)(f"/pagoda.v1.GenerationService/{method}")
        with pytest.raises(grpc.RpcError) as e:
            r = fn(_field(2, 2, b"\xff\xfe") if method != "Tokenize" else _field(1, 2, b"\xc3"), timeout=30)
            list(r) if method == "GenerateStream" else r
        assert e.value.code() == C.INVALID_ARGUMENT, e.value.details()
        assert "UTF-8" in e.value.details()


def test_server_survives_the_fuzz(srv, client):
    """Runs after the fuzzers (file order): still SERVING, every block free, no call or id held."""
    assert client.health() == "SERVING"
    assert client.health("pagoda.v1.GenerationService") == "SERVING"
    s = wait_all_blocks_free(client)
    server_idle(srv)
    assert s.kv_blocks_used == 0
    r = client.generate("Hello", temperature=0, max_tokens=4, ignore_eos=True)
    assert len(r.token_ids) == 4
    total = sum(SEEN.values())
    print(f"\nfuzz: {total} answers {dict(SEEN)}; blocks used after: {s.kv_blocks_used}")
    if total:  # when run alone (-k) the fuzzers may not have run
        assert SEEN["OK"] > 100 and SEEN["INVALID_ARGUMENT"] > 100 and SEEN["RESOURCE_EXHAUSTED"] > 0


def test_cli_json_keeps_unknown_enum_values():
    """A newer server may send a FinishReason this client does not know: printed as its number."""
    from pagoda.client.cli import _as_dict

    msg = pb.GenerateStreamResponse(request_id="r", text="a", finish_reason=99)
    assert _as_dict(msg)["finish_reason"] == 99
    msg = pb.GenerateStreamResponse(finish_reason=pb.FINISH_REASON_EOS)
    assert _as_dict(msg)["finish_reason"] == "FINISH_REASON_EOS"
