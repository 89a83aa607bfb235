"""The OpenAI requests this server takes (pydantic models, OpenAI's field names and vLLM's for the
extras), and what a request's sampling fields mean to the engine (SamplingParams)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured.manager import StructuredOutputs


def _whole_number(value):
    """JSON Schema's integer: 2.0 is one (strict types otherwise)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]


class _Fields(BaseModel):
    # OpenAI's types exactly ("16" is not an integer, true is not 1); null is each field's default;
    # an unknown field is refused by name
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Fields):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; chunks are not padded


class JsonSchemaFormat(_Fields):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Fields):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Fields):
    model: str | None = None
    n: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    priority: Int | None = None
    return_token_ids: bool | None = None  # vLLM's name: each choice (and stream chunk) also carries its token ids
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: Int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias in [-100, 100]
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob, with this many alternatives
    time_limit_ms: Int | None = None  # pagoda's: end with what was generated (finish_reason "time_limit")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]] | None
    max_tokens: Int | None = None  # null: 16 (OpenAI's default for completions)
    logprobs: Int | None = None
    echo: bool | None = None
    best_of: Int | None = None  # only its default: n
    suffix: str | None = None  # only its default: none


class EmbeddingRequest(_Fields):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's truncate_prompt_tokens (-1: the model's length),
    normalize and priority; prompt_name (pagoda's) puts one of a sentence-transformers model's prompts
    before each text."""
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int | None = None
    user: str | None = None  # accepted, not used
    truncate_prompt_tokens: Int | None = None
    normalize: bool | None = None
    priority: Int | None = None
    prompt_name: str | None = None


class ScoreRequest(_Fields):
    """vLLM's POST /v1/score: text_1 against each text_2 (one against many, or pairwise lists of one length)."""
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int | None = None
    priority: Int | None = None
    user: str | None = None


class RerankRequest(_Fields):
    """vLLM's (Jina's, Cohere's) POST /v1/rerank: documents ordered by relevance to the query."""
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Int | None = None
    return_documents: bool | None = None
    truncate_prompt_tokens: Int | None = None
    priority: Int | None = None
    user: str | None = None


class ChatMessage(BaseModel):
    # one model for every role: what each role may carry is checked in chat.py, with the
    # message's index in the error
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    refusal: str | None = None  # an assistant message as the SDK returned it, sent back as is
    annotations: list | None = None
    audio: dict | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    # OpenAI's fields that only their default (or null) can mean here
    store: bool | None = None
    metadata: dict[str, str] | None = None  # accepted, not used (OpenAI keeps it with stored completions)
    service_tier: str | None = None
    modalities: list[str] | None = None
    moderation: dict | None = None
    prompt_cache_retention: str | None = None  # accepted, not used: prefix caching keeps what memory allows
    prompt_cache_options: dict | None = None  # likewise
    reasoning_effort: str | None = None
    verbosity: str | None = None
    safety_identifier: str | None = None  # accepted, not used
    prompt_cache_key: str | None = None  # accepted, not used: prefix caching needs no key
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: only server/chat/reasoning.py TEMPLATE_KWARGS (enable_thinking)


class LoadLoRAAdapterRequest(_Fields):  # vLLM's POST /v1/load_lora_adapter
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Fields):  # vLLM's POST /v1/unload_lora_adapter
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored


class TokenizeRequest(_Fields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # accepted: the prompt always ends ready for the reply
    return_token_strs: bool | None = None


class DetokenizeRequest(_Fields):
    model: str | None = None
    tokens: list[Int]


# Fields of OpenAI's that this server takes only at a value that changes nothing (besides null).
_ONLY_DEFAULTS = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"], []), "moderation": (),
                  "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
                  "functions": ([],), "function_call": ("none",),
                  "suffix": ("",)}


def check_unsupported(body: _Fields) -> None:
    """A field this server cannot honour: a 400 naming it, unless its value changes nothing."""
    for name, harmless in _ONLY_DEFAULTS.items():
        value = getattr(body, name, None)
        if value is not None and value not in harmless:
            raise InvalidRequestError(name, f"is not supported by this server (got {_short(value)})")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        raise InvalidRequestError("best_of", f"other than n is not supported by this server (got {best_of})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def sampling_params(body: _Sampling, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; InvalidRequestError (its field) for a bad value."""
    check_unsupported(body)
    names = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "truncate_prompt_tokens", "prompt_logprobs", "time_limit_ms")
    kw = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = max(prompt_logprobs, kw.get("prompt_logprobs") or 0)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if body.logit_bias:
        try:
            kw["logit_bias"] = {int(t): b for t, b in body.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias", "keys must be token ids (integers as strings)") from None
    so, param = structured(body)
    try:
        kw["structured_outputs"] = so and StructuredOutputs(**so)
    except InvalidRequestError as e:
        raise renamed(e, param) from None
    return SamplingParams(**kw, max_tokens=max_tokens, stop=stop, stop_token_ids=body.stop_token_ids or [],
                          ignore_eos=bool(body.ignore_eos), logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                          skip_special_tokens=body.skip_special_tokens is not False, bad_words=body.bad_words or [],
                          include_stop_str_in_output=bool(body.include_stop_str_in_output))


def structured(body: _Sampling) -> tuple[dict | None, str | None]:
    """The request's structured output, as StructuredOutputs' fields, and the field that gave it."""
    given = []
    rf = getattr(body, "response_format", None)  # another API's body has none of these fields
    if rf is not None and rf.type == "json_object":
        given.append(({"json_object": True}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required with type json_schema")
        given.append(({"json": rf.json_schema.schema_}, "response_format.json_schema.schema"))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        fields = {"json" if k == "json_" else k: v for k, v in so.model_dump(exclude_none=True).items()}
        given.append((fields, "structured_outputs." + next(iter(fields), "json")))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}", None)
        if value is not None:
            given.append(({kind: value}, f"guided_{kind}"))
    if len(given) > 1:
        raise InvalidRequestError(given[1][1], f"conflicts with {given[0][1]}: set one structured output")
    return given[0] if given else (None, None)


def renamed(e: InvalidRequestError, param: str) -> InvalidRequestError:
    """A structured output's error under the field the request gave it in (an index kept)."""
    _, bracket, index = e.field.partition("[")
    return e.renamed(param + bracket + index)


class ResponsesTextFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Fields):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None  # accepted, not used


class ResponsesRequest(_Fields):
    """POST /v1/responses (OpenAI's Responses API), stateless: what a chat request can say, in its shape."""
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: ResponsesText | None = None
    stream: bool | None = None
    stream_options: dict | None = None  # accepted (include_obfuscation): events are not padded
    previous_response_id: str | None = None  # refused: this server keeps no responses
    conversation: str | dict | None = None  # likewise
    store: bool | None = None  # accepted: nothing is stored whatever it says
    include: list[str] | None = None  # only []: no extra output
    metadata: dict[str, str] | None = None
    truncation: str | None = None  # only "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    reasoning: dict | None = None  # only null / {} (no effort setting here)
    background: bool | None = None  # only false
    max_tool_calls: Int | None = None  # only null
    top_logprobs: Int | None = None  # only null / 0
    # vLLM's extras, as in chat
    seed: Int | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict | None = None
    time_limit_ms: Int | None = None  # pagoda's, as in chat: status "incomplete", reason "time_limit"
