"""Protobuf <-> engine conversion at the edge of the server, with request validation.

Every check names the request field the way a client spells it ("sampling.top_p must be in (0, 1],
got 1.5"), so the error text is useful without reading server code. Checks that need the model
(vocabulary, context length) use the engine's ModelInfo.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.v1 import generation_pb2 as pb

if TYPE_CHECKING:  # the engine package pulls in torch; annotations only
    from engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 256  # when the request leaves stopping.max_tokens unset (capped by the context)
MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16  # default of --max-stop-strings
MAX_STOP_STRING_LEN = 256  # default of --max-stop-string-len (characters)
MAX_STOP_TOKEN_IDS = 64  # default of --max-stop-token-ids
MAX_SEED = 2**63 - 1
MAX_N = 64  # engine.sampling_params.MAX_N
MAX_TOP_LOGPROBS = 20  # engine.sampling_params.MAX_TOP_LOGPROBS (not imported here: it pulls in torch)

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop_string": pb.FINISH_REASON_STOP_STRING,
    "stop_token": pb.FINISH_REASON_STOP_TOKEN,
    "eos": pb.FINISH_REASON_EOS,
    "abort": pb.FINISH_REASON_ABORTED,
}

# Engine field names (InvalidRequestError.field) -> the request field a client sees.
ENGINE_FIELDS = {
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "n": "sampling.n",
}


class RequestError(ValueError):
    """A bad request; `field` is the request field at fault. Maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


def engine_error_message(field: str, message: str) -> str:
    """The client-facing text of an engine InvalidRequestError."""
    return f"{ENGINE_FIELDS.get(field, field)}: {message}"


@dataclass
class RequestLimits:
    """The request limits the server enforces (server/main.py flags). None: the model's context."""
    max_prompt_tokens: int | None = None  # --max-prompt-tokens; None: context_length - 1
    max_tokens_limit: int | None = None  # --max-tokens-limit; None: context_length
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or unset, got {v!r}")
        for name in ("max_stop_strings", "max_stop_string_len", "max_stop_token_ids"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    def prompt_tokens(self, context: int) -> int:
        """The most prompt tokens accepted: the flag, but always leaving room for one new token."""
        room = context - 1
        return room if self.max_prompt_tokens is None else min(self.max_prompt_tokens, room)

    def max_tokens(self, context: int) -> int:
        return context if self.max_tokens_limit is None else min(self.max_tokens_limit, context)


DEFAULT_LIMITS = RequestLimits()


@dataclass
class EngineRequest:
    """What the servicer hands to AsyncEngine.generate."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int


def _finite(field: str, value: float, lo: float | None, hi: float | None, rule: str) -> float:
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(field, f"must be {rule}, got {value!r}")
    return value


def _sampling(s: pb.SamplingParams) -> dict:
    out = {}
    if s.HasField("temperature"):
        out["temperature"] = _finite("sampling.temperature", s.temperature, 0.0, None, ">= 0")
    if s.HasField("top_k"):
        if s.top_k < -1:
            raise RequestError("sampling.top_k", f"must be >= -1 (0 or -1: off), got {s.top_k}")
        out["top_k"] = s.top_k
    if s.HasField("top_p"):
        if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
            raise RequestError("sampling.top_p", f"must be in (0, 1], got {s.top_p!r}")
        out["top_p"] = s.top_p
    if s.HasField("min_p"):
        out["min_p"] = _finite("sampling.min_p", s.min_p, 0.0, 1.0, "in [0, 1]")
    if s.HasField("seed"):
        if s.seed > MAX_SEED:
            raise RequestError("sampling.seed", f"must be in [0, 2^63 - 1], got {s.seed}")
        out["seed"] = s.seed
    if s.HasField("repetition_penalty"):
        v = s.repetition_penalty
        if not (math.isfinite(v) and v > 0):
            raise RequestError("sampling.repetition_penalty", f"must be > 0, got {v!r}")
        out["repetition_penalty"] = v
    for name in ("presence_penalty", "frequency_penalty"):
        if s.HasField(name):
            out[name] = _finite(f"sampling.{name}", getattr(s, name), -2.0, 2.0, "in [-2, 2]")
    if s.HasField("n"):
        if not 1 <= s.n <= MAX_N:
            raise RequestError("sampling.n", f"must be in [1, {MAX_N}], got {s.n}")
        out["n"] = s.n
    return out


def prompt_tokens(req, engine, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, list[int]]:
    """Returns (field name, token ids) of the request's prompt; raises RequestError for a missing,
    empty, out-of-vocabulary or too long prompt. Tokenizing a long text takes a while: the
    servicer calls this in a thread for large prompts."""
    field_, ids = _prompt(req, engine, limits)
    most = limits.prompt_tokens(engine.model_info.max_model_len)
    if len(ids) > most:
        raise RequestError(field_, f"is {len(ids)} tokens, more than the {most} prompt tokens this server accepts "
                                   f"(--max-prompt-tokens, and the context_length "
                                   f"{engine.model_info.max_model_len} less one for the completion)")
    return field_, ids


def _prompt(req, engine, limits: RequestLimits) -> tuple[str, list[int]]:
    info = engine.model_info
    which = req.WhichOneof("prompt")
    if which is None:
        raise RequestError("prompt", "must be set: one of text, token_ids, messages")
    if which == "text":
        if not req.text:
            raise RequestError("text", "must not be empty")
        return "text", list(engine.encode(req.text))
    if which == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise RequestError("token_ids.ids", "must not be empty")
        most = limits.prompt_tokens(info.max_model_len)
        if len(ids) > most:  # before the per-id check: a huge list is refused at once
            raise RequestError("token_ids.ids", f"holds {len(ids)} tokens, more than the {most} prompt tokens this "
                                                f"server accepts (--max-prompt-tokens, and the context_length "
                                                f"{info.max_model_len} less one for the completion)")
        for i, t in enumerate(ids):
            if t >= info.vocab_size:
                raise RequestError(f"token_ids.ids[{i}]", f"must be < vocab_size ({info.vocab_size}), got {t}")
        return "token_ids", ids
    msgs = req.messages.messages
    if not msgs:
        raise RequestError("messages.messages", "must not be empty")
    for i, m in enumerate(msgs):
        if not m.role:
            raise RequestError(f"messages.messages[{i}].role", "must not be empty")
    try:
        ids = list(engine.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs]))
    except Exception as e:  # no template, a role the template rejects, ...: the request's fault
        raise RequestError("messages", f"cannot be rendered with the model's chat template: {e}") from e
    if not ids:
        raise RequestError("messages", "rendered to an empty prompt")
    return "messages", ids


def to_engine_request(req: pb.GenerateRequest | pb.GenerateStreamRequest, engine,
                      limits: RequestLimits = DEFAULT_LIMITS, request_id: str | None = None,
                      prompt: tuple[str, list[int]] | None = None) -> EngineRequest:
    """Validates a Generate(Stream)Request and converts it; raises RequestError naming the field.
    `request_id` (e.g. from x-request-id metadata) applies when the request's own is empty; `prompt`
    is prompt_tokens()'s result when the caller already has it."""
    info = engine.model_info
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError("request_id", f"must be at most {MAX_REQUEST_ID_LEN} characters, got {len(req.request_id)}")
    request_id = req.request_id or request_id or uuid.uuid4().hex
    st = req.stopping
    # Cheap checks on sizes first, so a huge request is refused before any tokenizing.
    check_sizes(req, limits)
    field_, prompt = prompt if prompt is not None else prompt_tokens(req, engine, limits)
    kw = _sampling(req.sampling)

    context = info.max_model_len
    room = context - len(prompt)
    if room < 1:
        raise RequestError(field_, f"is {len(prompt)} tokens, which leaves no room in the context "
                                   f"(context_length {context})")
    if st.HasField("max_tokens"):
        if st.max_tokens < 1:
            raise RequestError("stopping.max_tokens", f"must be >= 1, got {st.max_tokens}")
        if st.max_tokens > room:
            raise RequestError("stopping.max_tokens", f"({st.max_tokens}) plus the prompt ({len(prompt)} tokens) "
                                                      f"must fit the context_length ({context})")
        most = limits.max_tokens(context)
        if st.max_tokens > most:
            raise RequestError("stopping.max_tokens", f"must be at most {most} (this server's --max-tokens-limit), "
                                                      f"got {st.max_tokens}")
        max_tokens = st.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room, limits.max_tokens(context))
    min_tokens = st.min_tokens if st.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        raise RequestError("stopping.min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    for i, t in enumerate(st.stop_token_ids):
        if t >= info.vocab_size:
            raise RequestError(f"stopping.stop_token_ids[{i}]", f"must be < vocab_size ({info.vocab_size}), got {t}")

    top_logprobs = req.top_logprobs if req.HasField("top_logprobs") else 0
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise RequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")

    from engine import SamplingParams  # the engine is loaded by the time requests arrive

    params = SamplingParams(
        **kw,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        logprobs=req.logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
    return EngineRequest(request_id=request_id, prompt=prompt, params=params, priority=req.priority)


def check_sizes(req, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """The limits on repeated fields and stop strings, which need no model."""
    st = req.stopping
    if len(st.stop) > limits.max_stop_strings:
        raise RequestError("stopping.stop", f"must hold at most {limits.max_stop_strings} strings "
                                            f"(--max-stop-strings), got {len(st.stop)}")
    for i, s in enumerate(st.stop):
        if not s:
            raise RequestError(f"stopping.stop[{i}]", "must not be empty")
        if len(s) > limits.max_stop_string_len:
            raise RequestError(f"stopping.stop[{i}]", f"must be at most {limits.max_stop_string_len} characters "
                                                      f"(--max-stop-string-len), got {len(s)}")
    if len(st.stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError("stopping.stop_token_ids", f"must hold at most {limits.max_stop_token_ids} ids "
                                                      f"(--max-stop-token-ids), got {len(st.stop_token_ids)}")


def finish_reason(out) -> int:
    """The FinishReason of an engine RequestOutput (UNSPECIFIED while not finished)."""
    if not out.finished:
        return pb.FINISH_REASON_UNSPECIFIED
    return FINISH_REASONS.get(out.stop_reason or out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)


def usage(out) -> pb.Usage:
    return pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_generated_tokens,
                    cached_prompt_tokens=out.num_cached_tokens)


def logprobs(items) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
            for lp in items or ()]


def stream_response(request_id: str, out) -> pb.GenerateStreamResponse:
    """One engine delta as a stream message; finish_reason and usage only on the last one."""
    msg = pb.GenerateStreamResponse(request_id=request_id, text=out.text, token_ids=out.token_ids,
                                    logprobs=logprobs(out.logprobs), index=out.index)
    if out.finished:
        msg.finish_reason = finish_reason(out)
        msg.usage.CopyFrom(usage(out))
    return msg


def model_info(info, limits_default_max_tokens: int = DEFAULT_MAX_TOKENS, limits: RequestLimits = DEFAULT_LIMITS,
               max_message_bytes: int = 0, max_concurrent_streams: int = 0,
               request_timeout: float = 0.0) -> pb.GetModelInfoResponse:
    context = info.max_model_len
    return pb.GetModelInfoResponse(
        model_id=info.model_id or "",
        architecture=info.architecture,
        dtype=info.dtype,
        context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        limits=pb.ServerLimits(
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_queue_len=info.max_queue_len,
            default_max_tokens=min(limits_default_max_tokens, limits.max_tokens(context)),
            max_top_logprobs=MAX_TOP_LOGPROBS,
            max_prompt_tokens=limits.prompt_tokens(context),
            max_tokens_limit=limits.max_tokens(context),
            max_stop_strings=limits.max_stop_strings,
            max_stop_string_len=limits.max_stop_string_len,
            max_stop_token_ids=limits.max_stop_token_ids,
            max_message_bytes=max_message_bytes,
            max_concurrent_streams=max_concurrent_streams,
            request_timeout_seconds=request_timeout,
        ),
    )


def stats(s) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_blocks_total=s.num_total_blocks,
        kv_blocks_free=s.num_free_blocks,
        kv_blocks_used=s.num_used_blocks,
        prompt_tokens_processed=s.num_prompt_tokens_processed,
        generated_tokens=s.num_generated_tokens,
        num_preemptions=s.num_preemptions,
        uptime_seconds=s.uptime_s,
        kv_blocks_cached=s.num_cached_blocks,
        cached_prompt_tokens=s.num_cached_prompt_tokens,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate,
    )
