"""Protobuf <-> engine conversion at the edge of the gRPC server.

The rules a request must meet live in engine/validation.py (torch-free, shared with every door);
here a request's fields become a prompt and SamplingParams, and an InvalidRequestError's field
becomes the request field a client spells: "stopping.max_tokens must be >= 1, got 0".
"""
from __future__ import annotations

from pagoda.engine.core_io import EngineRequest
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.outputs import FINISH_REASONS
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured import StructuredOutputs
from pagoda.engine.validation import (MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS, RequestLimits,
                                     new_request_id)
from pagoda.server.options import ServerOptions
from pagoda.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 256  # when the request leaves stopping.max_tokens unset (capped by the context)
DEFAULT_LIMITS = ServerOptions().request_limits()  # `pagoda serve`'s, when a caller gives none

# The engine's field names -> the request's; the prompt's depends on which prompt the request gave.
FIELDS = {
    **{name: f"sampling.{name}" for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                                             "presence_penalty", "frequency_penalty", "n", "logit_bias",
                                             "bad_words")},
    **{name: f"stopping.{name}" for name in ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                                             "include_stop_str_in_output")},
}
FIELDS.update({"structured_outputs": "structured_output", "structured_outputs.json": "structured_output.json_schema",
               "structured_outputs.choice": "structured_output.choice.choices",
               **{f"structured_outputs.{k}": f"structured_output.{k}" for k in ("json_object", "regex", "grammar")}})
PROMPT_FIELDS = {"text": "text", "token_ids": "token_ids.ids", "messages": "messages"}


def grpc_error(e: InvalidRequestError, prompt: str | None, where: str = "") -> InvalidRequestError:
    """The error under the request's name for its field (`prompt`: the prompt oneof given; `where`: the
    path of that prompt among several, e.g. "prompts.prompts[2].")."""
    base, bracket, index = e.field.partition("[")
    if base in ("prompt", "prompt_token_ids"):
        name = where + (PROMPT_FIELDS[prompt] if prompt is not None else "prompt")
    elif base.split(".")[0] in PROMPT_FIELDS:  # a part of the prompt: messages.messages[0].role
        name = where + base
    else:
        name = FIELDS.get(base, base)
    return e.renamed(name + bracket + index)


def to_engine_requests(req: pb.GenerateRequest | pb.GenerateStreamRequest, engine,
                       limits: RequestLimits = DEFAULT_LIMITS, request_id: str | None = None) -> list[EngineRequest]:
    """A Generate(Stream)Request as checked, tokenized requests (engine.make_request): one, or one per
    prompt of `prompts` (ids suffixed -0, -1, ...). Raises InvalidRequestError naming the request's
    field. `request_id` (e.g. from x-request-id metadata) applies when the request's own is empty.
    Rendering and tokenizing a long prompt takes a while: the servicer calls this in a thread for
    large prompts."""
    which = req.WhichOneof("prompt")
    rid = req.request_id or request_id
    try:
        params = _params(req)
    except InvalidRequestError as e:
        raise grpc_error(e, which) from None
    if which != "prompts":
        return [_request(req, which, "", params, rid, req, engine, limits)]
    prompts = req.prompts.prompts
    if not prompts:
        raise InvalidRequestError("prompts.prompts", "must hold at least one prompt")
    rid = rid or new_request_id()
    return [_request(p, p.WhichOneof("prompt"), f"prompts.prompts[{i}].", params, f"{rid}-{i}", req, engine, limits)
            for i, p in enumerate(prompts)]


def to_engine_request(req, engine, limits: RequestLimits = DEFAULT_LIMITS,
                      request_id: str | None = None) -> EngineRequest:
    """The request of a single-prompt Generate(Stream)Request."""
    return to_engine_requests(req, engine, limits, request_id)[0]


def _request(source, which, where: str, params, rid, req, engine, limits) -> EngineRequest:
    try:
        return engine.make_request(_prompt(source, which, engine), params, rid, req.priority,
                                   limits=limits, default_max_tokens=DEFAULT_MAX_TOKENS)
    except InvalidRequestError as e:
        raise grpc_error(e, which, where) from None


def _params(req) -> SamplingParams:
    s, st = req.sampling, req.stopping
    kw = {name: getattr(s, name) for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                                               "presence_penalty", "frequency_penalty", "n") if s.HasField(name)}
    for name in ("max_tokens", "min_tokens"):
        kw[name] = getattr(st, name) if st.HasField(name) else None
    kw["min_tokens"] = kw["min_tokens"] or 0
    top_logprobs = req.top_logprobs if req.HasField("top_logprobs") else 0
    if s.logit_bias:
        kw["logit_bias"] = dict(s.logit_bias)
    if st.HasField("include_stop_str_in_output"):
        kw["include_stop_str_in_output"] = st.include_stop_str_in_output
    if s.bad_words:
        kw["bad_words"] = list(s.bad_words)
    for name in ("skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs"):
        if req.HasField(name):
            kw[name] = getattr(req, name)
    if req.HasField("structured_output"):
        kw["structured_outputs"] = _structured(req.structured_output)
    return SamplingParams(**kw, stop=list(st.stop), stop_token_ids=list(st.stop_token_ids), ignore_eos=st.ignore_eos,
                          logprobs=req.logprobs or top_logprobs > 0, top_logprobs=top_logprobs)


def _structured(so: pb.StructuredOutput) -> StructuredOutputs:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", "must set one of json_schema, json_object, regex, choice, "
                                                        "grammar")
    value = getattr(so, kind)
    if kind == "json_object" and not value:
        raise InvalidRequestError("structured_outputs.json_object", "must be true")
    if kind == "choice":
        value = list(value.choices)
    return StructuredOutputs(**{"json" if kind == "json_schema" else kind: value})


def _prompt(req, which: str | None, engine) -> str | list[int]:
    """The text as is (the engine tokenizes it), the token ids, or the messages through the chat template."""
    if which is None:
        raise InvalidRequestError("prompt", "must be set: one of text, token_ids, messages, prompts")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    msgs = req.messages.messages
    if not msgs:
        raise InvalidRequestError("messages.messages", "must not be empty")
    for i, m in enumerate(msgs):
        if not m.role:
            raise InvalidRequestError(f"messages.messages[{i}].role", "must not be empty")
    try:
        ids = list(engine.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs]))
    except InvalidRequestError as e:
        raise e.renamed(f"messages.{e.field}") from None
    except Exception as e:  # no template, a role the template rejects, ...: the request's fault
        raise InvalidRequestError("messages", f"cannot be rendered with the model's chat template: {e}") from e
    if not ids:
        raise InvalidRequestError("messages", "rendered to an empty prompt")
    return ids


def finish_reason(out) -> int:
    """The FinishReason of an engine RequestOutput (UNSPECIFIED while not finished), through the one map."""
    names = FINISH_REASONS.get(out.stop_reason) if out.finished else None
    return pb.FinishReason.Value("FINISH_REASON_" + names.grpc) if names else pb.FINISH_REASON_UNSPECIFIED


def usage(out) -> pb.Usage:
    return pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_generated_tokens,
                    cached_prompt_tokens=out.num_cached_tokens)


def total_usage(responses: list[pb.GenerateResponse]) -> pb.Usage:
    usage = pb.Usage()
    for r in responses:
        for name in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
            setattr(usage, name, getattr(usage, name) + getattr(r.usage, name))
    return usage


def logprobs(items) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
            for lp in items or ()]


def prompt_logprobs(items) -> list[pb.TokenLogprob]:
    """An output's prompt logprobs without the first token's (None: nothing predicts it)."""
    return logprobs((items or [None])[1:])


def stream_response(request_id: str, out, prompt_index: int = 0) -> pb.GenerateStreamResponse:
    """One engine delta as a stream message; finish_reason and usage only on the last one."""
    msg = pb.GenerateStreamResponse(request_id=request_id, text=out.text, token_ids=out.token_ids,
                                    logprobs=logprobs(out.logprobs), index=out.index, prompt_index=prompt_index,
                                    prompt_logprobs=prompt_logprobs(out.prompt_logprobs))
    if out.finished:
        msg.finish_reason = finish_reason(out)
        msg.usage.CopyFrom(usage(out))
    return msg


def response(req, outs: list, prompt_text: str | None = None) -> pb.GenerateResponse:
    """One prompt's whole completions (finished outputs, by index) as a GenerateResponse; with
    `prompt_text` (echo) the prompt too."""
    choices = [pb.Choice(index=o.index, text=o.text, token_ids=o.token_ids, finish_reason=finish_reason(o),
                         logprobs=logprobs(o.logprobs)) for o in outs]
    total = usage(outs[0])
    total.completion_tokens = sum(o.num_generated_tokens for o in outs)
    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    resp = pb.GenerateResponse(request_id=req.request_id, text=choices[0].text, token_ids=choices[0].token_ids,
                               finish_reason=choices[0].finish_reason, usage=total, logprobs=choices[0].logprobs,
                               choices=choices, prompt_logprobs=prompt_logprobs(prompt_lps))
    if prompt_text is not None:
        resp.prompt_text = prompt_text
        resp.prompt_token_ids.extend(req.prompt_token_ids)
    return resp


def model_info(info, limits_default_max_tokens: int = DEFAULT_MAX_TOKENS, limits: RequestLimits = DEFAULT_LIMITS,
               max_message_bytes: int = 0, max_concurrent_streams: int = 0,
               request_timeout: float = 0.0) -> pb.GetModelInfoResponse:
    context = info.max_model_len
    return pb.GetModelInfoResponse(
        model_id=info.model_id or "",
        architecture=info.architecture,
        dtype=info.dtype,
        quantization=info.quantization,
        deterministic=info.deterministic,
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
            max_stop_strings=limits.max_stop_strings or 0,
            max_stop_string_len=limits.max_stop_string_len or 0,
            max_stop_token_ids=limits.max_stop_token_ids or 0,
            max_message_bytes=max_message_bytes,
            max_concurrent_streams=max_concurrent_streams,
            request_timeout_seconds=request_timeout,
            max_logit_bias=MAX_LOGIT_BIAS,
            max_bad_words=MAX_BAD_WORDS,
            max_n=MAX_N,
            max_prompt_logprobs=MAX_TOP_LOGPROBS,
            max_grammar_bytes=limits.max_grammar_bytes or 0,
            grammar_compile_timeout_seconds=limits.grammar_compile_timeout or 0.0,
        ),
    )
