"""Protobuf <-> engine conversion at the edge of the gRPC server.

The rules a request must meet live in engine/validation.py (torch-free, shared with every door);
here a request's fields become a prompt and SamplingParams, and an InvalidRequestError's field
becomes the request field a client spells: "stopping.max_tokens must be >= 1, got 0".
"""
from __future__ import annotations

import dataclasses
import json

from pagoda.engine.core.core_io import EngineRequest
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.outputs import FINISH_REASONS
from pagoda.engine.pooling import PoolingParams, with_prompt
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured.manager import StructuredOutputs
from pagoda.engine.validation import (MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS, RequestLimits,
                                     new_request_id)
from pagoda.server.chat.answer import PLAIN, AnswerReader
from pagoda.server.chat.requests import chat_request, render
from pagoda.server.chat.tools import check_tools, ends_in_calls, message_tool_fields
from pagoda.server.options import ServerOptions
from pagoda.server.scoring import pair_inputs, pair_scores, ranked
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
# the engine's (OpenAI's) names of a tool's fields -> the request's
TOOL_FIELDS = {"tool_choice.function.name": "tool_choice.function_name", ".function.name": ".name",
               ".function.parameters": ".parameters_json"}
TOOL_MODES = {pb.TOOL_CHOICE_MODE_UNSPECIFIED: "auto", pb.TOOL_CHOICE_MODE_NONE: "none",
              pb.TOOL_CHOICE_MODE_AUTO: "auto", pb.TOOL_CHOICE_MODE_REQUIRED: "required"}


def grpc_error(e: InvalidRequestError, prompt: str | None, where: str = "") -> InvalidRequestError:
    """The error under the request's name for its field (`prompt`: the prompt oneof given; `where`: the
    path of that prompt among several, e.g. "prompts.prompts[2].")."""
    base, bracket, index = e.field.partition("[")
    if base in ("prompt", "prompt_token_ids"):
        name = where + (PROMPT_FIELDS[prompt] if prompt is not None else "prompt")
    elif base.split(".")[0] in PROMPT_FIELDS:  # a part of the prompt: messages.messages[0].role
        name = where + base
    elif base.startswith("tool"):  # tools[0].function.name -> tools[0].name
        name = e.field
        for engine_name, ours in TOOL_FIELDS.items():
            name = name.replace(engine_name, ours)
        return e.renamed(name)
    else:
        name = FIELDS.get(base, base)
    return e.renamed(name + bracket + index)


def to_engine_requests(req: pb.GenerateRequest | pb.GenerateStreamRequest, engine,
                       limits: RequestLimits = DEFAULT_LIMITS, request_id: str | None = None,
                       options: ServerOptions | None = None) -> tuple[list[EngineRequest], AnswerReader]:
    """A Generate(Stream)Request as checked, tokenized requests (engine.make_request): one, or one per
    prompt of `prompts` (ids suffixed -0, -1, ...), and the reader of their answers (a chat's tool
    calls and reasoning; server/chat/). Raises InvalidRequestError naming the request's
    field. `request_id` (e.g. from x-request-id metadata) applies when the request's own is empty.
    Rendering and tokenizing a long prompt takes a while: the servicer calls this in a thread for
    large prompts. A request's `adapter` (a LoRA adapter's name) must be loaded (else NOT_FOUND)."""
    adapter = req.adapter if req.HasField("adapter") else None
    if adapter is not None:
        engine.check_adapter(adapter)
    reqs, reader = _engine_requests(req, engine, limits, request_id, options)
    return (reqs if adapter is None else [dataclasses.replace(r, adapter=adapter) for r in reqs]), reader


def _engine_requests(req, engine, limits: RequestLimits, request_id: str | None,
                     options: ServerOptions | None) -> tuple[list[EngineRequest], AnswerReader]:
    which = req.WhichOneof("prompt")
    rid = req.request_id or request_id
    try:
        params = _params(req)
        tools = _tools(req, which)
    except InvalidRequestError as e:
        raise grpc_error(e, which) from None
    if which == "messages":  # a chat: tools, reasoning
        options = options or ServerOptions()
        make = lambda ids, p: engine.make_request(ids, p, rid, req.priority, limits=limits,  # noqa: E731
                                                  default_max_tokens=DEFAULT_MAX_TOKENS)
        try:
            r, reader = chat_request(engine, _messages(req.messages.messages), params, make, tools=tools,
                                     tool_call_parser=options.tool_call_parser,
                                     reasoning_parser=options.reasoning_parser)
            return [r], reader
        except InvalidRequestError as e:
            raise grpc_error(_in_messages(e), which) from None
    if which != "prompts":
        return [_request(req, which, "", params, rid, req, engine, limits)], PLAIN
    prompts = req.prompts.prompts
    if not prompts:
        raise InvalidRequestError("prompts.prompts", "must hold at least one prompt")
    rid = rid or new_request_id()
    return [_request(p, p.WhichOneof("prompt"), f"prompts.prompts[{i}].", params, f"{rid}-{i}", req, engine, limits)
            for i, p in enumerate(prompts)], PLAIN


def to_engine_request(req, engine, limits: RequestLimits = DEFAULT_LIMITS,
                      request_id: str | None = None) -> EngineRequest:
    """The request of a single-prompt Generate(Stream)Request."""
    return to_engine_requests(req, engine, limits, request_id)[0][0]


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
    for name in ("skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "time_limit_ms"):
        if req.HasField(name):
            kw[name] = getattr(req, name)
    if req.HasField("structured_output"):
        kw["structured_outputs"] = _structured(req.structured_output)
    return SamplingParams(**kw, stop=list(st.stop), stop_token_ids=list(st.stop_token_ids), ignore_eos=st.ignore_eos,
                          logprobs=req.logprobs or top_logprobs > 0, top_logprobs=top_logprobs)


def _tools(req, which):
    """The request's tools as OpenAI's function tools (server/chat/tools.py checks them); None without tools."""
    if not req.tools:
        if req.HasField("tool_choice") or req.HasField("parallel_tool_calls"):
            raise InvalidRequestError("tools", "must be given with tool_choice or parallel_tool_calls")
        return None
    if which != "messages":
        raise InvalidRequestError("tools", "need a messages prompt (the chat template renders them)")
    tools = []
    for i, t in enumerate(req.tools):
        f = {"name": t.name}
        if t.description:
            f["description"] = t.description
        if t.parameters_json:
            try:
                f["parameters"] = json.loads(t.parameters_json)
            except ValueError as e:
                raise InvalidRequestError(f"tools[{i}].function.parameters", f"is not JSON text: {e}") from None
        if t.HasField("strict"):
            f["strict"] = t.strict
        tools.append({"type": "function", "function": f})
    c = req.tool_choice
    which_choice = c.WhichOneof("choice") if req.HasField("tool_choice") else None
    choice = ({"type": "function", "function": {"name": c.function_name}} if which_choice == "function_name"
              else TOOL_MODES.get(c.mode, c.mode) if which_choice == "mode" else None)
    return check_tools(tools, choice, req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None)


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
    """The text as is (the engine tokenizes it), the token ids, or the messages through the chat template
    (a whole request's messages go through the chat layer's chat_request instead)."""
    if which is None:
        raise InvalidRequestError("prompt", "must be set: one of text, token_ids, messages, prompts")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    try:
        return render(engine, _messages(req.messages.messages))
    except InvalidRequestError as e:
        raise _in_messages(e) from None


def _in_messages(e: InvalidRequestError) -> InvalidRequestError:
    """The template's check of a message (messages[0].content) under the request's name for it."""
    return e.renamed("messages." + e.field) if e.field.startswith("messages[") else e


def _messages(msgs) -> list[dict]:
    """The request's messages as the chat template's dicts, checked."""
    if not msgs:
        raise InvalidRequestError("messages.messages", "must not be empty")
    for i, m in enumerate(msgs):
        if not m.role:
            raise InvalidRequestError(f"messages.messages[{i}].role", "must not be empty")
    messages = [{"role": m.role, "content": m.content, **message_tool_fields(
        f"messages.messages[{i}]", m.role, m.tool_call_id if m.HasField("tool_call_id") else None,
        [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
         for c in m.tool_calls])} for i, m in enumerate(msgs)]
    return messages


def finish_reason(out, calls=()) -> int:
    """The FinishReason of an engine RequestOutput (UNSPECIFIED while not finished), through the one map;
    TOOL_CALLS where it ended normally after tool calls."""
    reason = out.stop_reason
    if ends_in_calls(calls) and FINISH_REASONS.get(reason, FINISH_REASONS["error"]).openai == "stop":
        reason = "tool_calls"
    names = FINISH_REASONS.get(reason) if out.finished else None
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


def tool_calls(calls) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def tool_call_deltas(deltas) -> list[pb.ToolCallDelta]:
    return [pb.ToolCallDelta(index=d.index, id=d.call.id if d.first else "", name=d.call.name if d.first else "",
                             arguments=d.arguments) for d in deltas if d.first or d.arguments]


def stream_response(request_id: str, out, prompt_index: int = 0, answer=None) -> pb.GenerateStreamResponse:
    """One engine delta as a stream message; finish_reason and usage only on the last one. `answer`: the
    completion's AnswerStream (server/chat/tools.py) when a chat request's tool calls or reasoning are read."""
    new = answer.feed(out.text, out.finished) if answer is not None else None
    msg = pb.GenerateStreamResponse(request_id=request_id, text=new.content if new else out.text,
                                    token_ids=out.token_ids, logprobs=logprobs(out.logprobs), index=out.index,
                                    prompt_index=prompt_index, prompt_logprobs=prompt_logprobs(out.prompt_logprobs),
                                    tool_calls=tool_calls(new.calls if new else []),
                                    reasoning_content=(new and new.reasoning) or "",
                                    tool_call_deltas=tool_call_deltas(new.deltas if new else ()))
    if out.finished:
        msg.finish_reason = finish_reason(out, answer.calls if answer is not None else ())
        msg.usage.CopyFrom(usage(out))
    return msg


def response(req, outs: list, prompt_text: str | None = None, reader: AnswerReader = PLAIN) -> pb.GenerateResponse:
    """One prompt's whole completions (finished outputs, by index) as a GenerateResponse, read by
    `reader` (a chat's tool calls and reasoning); with `prompt_text` (echo) the prompt too."""
    choices = [_choice(reader, o) for o in outs]
    total = usage(outs[0])
    total.completion_tokens = sum(o.num_generated_tokens for o in outs)
    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    resp = pb.GenerateResponse(request_id=req.request_id, text=choices[0].text, token_ids=choices[0].token_ids,
                               finish_reason=choices[0].finish_reason, usage=total, logprobs=choices[0].logprobs,
                               choices=choices, prompt_logprobs=prompt_logprobs(prompt_lps),
                               tool_calls=choices[0].tool_calls, reasoning_content=choices[0].reasoning_content)
    if prompt_text is not None:
        resp.prompt_text = prompt_text
        resp.prompt_token_ids.extend(req.prompt_token_ids)
    return resp


def _choice(reader: AnswerReader, o) -> pb.Choice:
    """A whole completion; with tools, its calls apart from its text (server/chat/ reads them)."""
    answer = reader.read(o.text)
    return pb.Choice(index=o.index, text=answer.content, token_ids=o.token_ids,
                     finish_reason=finish_reason(o, answer.calls),
                     logprobs=logprobs(o.logprobs), tool_calls=tool_calls(answer.calls),
                     reasoning_content=answer.reasoning or "")


def model_info(info, limits_default_max_tokens: int = DEFAULT_MAX_TOKENS, limits: RequestLimits = DEFAULT_LIMITS,
               max_message_bytes: int = 0, max_concurrent_streams: int = 0,
               request_timeout: float = 0.0, max_queue_wait: float | None = None,
               lora: tuple[int, int] = (0, 0)) -> pb.GetModelInfoResponse:
    """lora: (max_loras, max_lora_rank), zeros when LoRA is off; info.adapters: those loaded."""
    context = info.max_model_len
    return pb.GetModelInfoResponse(
        adapters=[pb.LoRAAdapter(name=a.name, path=a.path, rank=a.rank, parent=info.model_id or "")
                  for a in info.adapters],
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
        speculative_config=info.speculative_config,
        runner=info.runner,
        hidden_size=info.hidden_size,
        weights_format=info.weights_format,
        weights_path=info.weights_path,
        weights_bytes=info.weights_bytes,
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
            max_queue_wait_seconds=max_queue_wait or 0.0,
            max_loras=lora[0],
            max_lora_rank=lora[1],
        ),
    )


# ---- Embed ----

def embed_requests(req: pb.EmbedRequest, engine, limits: RequestLimits, rid: str) -> list[EngineRequest]:
    """A pooling request per input, each error under the request's name for its field."""
    if not req.inputs:
        raise InvalidRequestError("inputs", "must hold at least one input")
    which = [x.WhichOneof("input") for x in req.inputs]
    inputs = [x.text if w == "text" else list(x.token_ids.ids) for x, w in zip(req.inputs, which)]
    inputs = with_prompt(inputs, engine.model_info.pooler, req.prompt_name or None)
    params = PoolingParams(normalize=req.normalize if req.HasField("normalize") else None,
                           dimensions=req.dimensions if req.HasField("dimensions") else None,
                           truncate_prompt_tokens=req.truncate_prompt_tokens or None)
    reqs = []
    for i, (x, w) in enumerate(zip(inputs, which)):
        if w is None:
            raise InvalidRequestError(f"inputs[{i}]", "must hold text or token_ids")
        try:
            reqs.append(engine.make_request(x, params, f"{rid}-{i}", req.priority, limits=limits, stream=False))
        except InvalidRequestError as e:
            raise grpc_error(e, w, f"inputs[{i}].") from None
    return reqs


def rerank_requests(req: pb.RerankRequest, engine, limits: RequestLimits, rid: str) -> list[EngineRequest]:
    """The query against each document (server/scoring.py): a pooling request per pair or per text."""
    if not req.documents:
        raise InvalidRequestError("documents", "must hold at least one document")
    n = len(req.documents)
    inputs, names, params = pair_inputs(engine, [req.query] * n, list(req.documents),
                                        ["query"] * n + [f"documents[{i}]" for i in range(n)],
                                        req.truncate_prompt_tokens or None)
    reqs = []
    for i, (x, name) in enumerate(zip(inputs, names)):
        try:
            reqs.append(engine.make_request(x, params, f"{rid}-{i}", req.priority, limits=limits, stream=False))
        except InvalidRequestError as e:
            if not e.field.startswith("prompt"):
                raise
            raise e.renamed(name) from None
    return reqs


def rerank_response(req: pb.RerankRequest, engine, outs: list) -> pb.RerankResponse:
    scores, tokens = pair_scores(engine, outs)
    top_n = req.top_n if req.HasField("top_n") else None
    return pb.RerankResponse(results=[pb.RerankResult(index=i, relevance_score=scores[i]) for i in ranked(scores, top_n)],
                             prompt_tokens=tokens)


def embed_response(outs: list) -> pb.EmbedResponse:
    """outs: (input index, whole output) pairs."""
    embeddings = [pb.Embedding(values=out.embedding.tolist(), prompt_tokens=out.num_prompt_tokens)
                  for _, out in sorted(outs, key=lambda x: x[0])]
    return pb.EmbedResponse(embeddings=embeddings, prompt_tokens=sum(e.prompt_tokens for e in embeddings))
