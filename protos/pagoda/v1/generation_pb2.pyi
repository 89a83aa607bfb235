from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR: _ClassVar[FinishReason]
    FINISH_REASON_TIME_LIMIT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_GRAMMAR: FinishReason
FINISH_REASON_TIME_LIMIT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    function_name: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., function_name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class Prompts(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "logit_bias", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    n: int
    logit_bias: _containers.ScalarMap[int, float]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "prompts", "sampling", "stopping", "logprobs", "top_logprobs", "priority", "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "echo", "structured_output", "time_limit_ms", "tools", "tool_choice", "parallel_tool_calls", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_MS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    prompts: Prompts
    sampling: SamplingParams
    stopping: StoppingCriteria
    logprobs: bool
    top_logprobs: int
    priority: int
    skip_special_tokens: bool
    truncate_prompt_tokens: int
    prompt_logprobs: int
    echo: bool
    structured_output: StructuredOutput
    time_limit_ms: int
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompts: _Optional[_Union[Prompts, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., time_limit_ms: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "prompts", "sampling", "stopping", "logprobs", "top_logprobs", "priority", "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "echo", "structured_output", "time_limit_ms", "tools", "tool_choice", "parallel_tool_calls", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_MS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    prompts: Prompts
    sampling: SamplingParams
    stopping: StoppingCriteria
    logprobs: bool
    top_logprobs: int
    priority: int
    skip_special_tokens: bool
    truncate_prompt_tokens: int
    prompt_logprobs: int
    echo: bool
    structured_output: StructuredOutput
    time_limit_ms: int
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompts: _Optional[_Union[Prompts, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., priority: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., time_limit_ms: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "tool_calls", "reasoning_content")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "logprobs", "choices", "prompt_logprobs", "prompt_token_ids", "prompt_text", "results", "tool_calls", "reasoning_content")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    results: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., results: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "logprobs", "index", "prompt_index", "prompt_logprobs", "prompt_token_ids", "prompt_text", "tool_calls", "reasoning_content", "tool_call_deltas")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    prompt_index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_queue_len", "default_max_tokens", "max_top_logprobs", "max_prompt_tokens", "max_tokens_limit", "max_stop_strings", "max_stop_string_len", "max_stop_token_ids", "max_message_bytes", "max_concurrent_streams", "request_timeout_seconds", "max_logit_bias", "max_bad_words", "max_n", "max_prompt_logprobs", "max_grammar_bytes", "grammar_compile_timeout_seconds", "max_queue_wait_seconds", "max_loras", "max_lora_rank")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRING_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAMMAR_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queue_len: int
    default_max_tokens: int
    max_top_logprobs: int
    max_prompt_tokens: int
    max_tokens_limit: int
    max_stop_strings: int
    max_stop_string_len: int
    max_stop_token_ids: int
    max_message_bytes: int
    max_concurrent_streams: int
    request_timeout_seconds: float
    max_logit_bias: int
    max_bad_words: int
    max_n: int
    max_prompt_logprobs: int
    max_grammar_bytes: int
    grammar_compile_timeout_seconds: float
    max_queue_wait_seconds: float
    max_loras: int
    max_lora_rank: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_queue_len: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_stop_string_len: _Optional[int] = ..., max_stop_token_ids: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_concurrent_streams: _Optional[int] = ..., request_timeout_seconds: _Optional[float] = ..., max_logit_bias: _Optional[int] = ..., max_bad_words: _Optional[int] = ..., max_n: _Optional[int] = ..., max_prompt_logprobs: _Optional[int] = ..., max_grammar_bytes: _Optional[int] = ..., grammar_compile_timeout_seconds: _Optional[float] = ..., max_queue_wait_seconds: _Optional[float] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "dtype", "context_length", "vocab_size", "eos_token_ids", "block_size", "num_kv_blocks", "limits", "quantization", "speculative_config", "deterministic", "adapters", "runner", "hidden_size", "weights_format", "weights_path", "weights_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    dtype: str
    context_length: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_kv_blocks: int
    limits: ServerLimits
    quantization: str
    speculative_config: str
    deterministic: bool
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    runner: str
    hidden_size: int
    weights_format: str
    weights_path: str
    weights_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., quantization: _Optional[str] = ..., speculative_config: _Optional[str] = ..., deterministic: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., runner: _Optional[str] = ..., hidden_size: _Optional[int] = ..., weights_format: _Optional[str] = ..., weights_path: _Optional[str] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "parent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    parent: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "prompt_tokens_processed", "generated_tokens", "num_preemptions", "uptime_seconds", "kv_blocks_cached", "cached_prompt_tokens", "prefix_cache_hit_rate", "queue_wait_estimate_seconds", "step_seconds", "finished_per_second", "spec_proposed_tokens", "spec_accepted_tokens", "spec_mean_accepted_length", "adapter_requests", "adapter_generated_tokens", "pooling_requests", "pooling_tokens", "kv_groups", "expert_load", "state_slots_total", "state_slots_used")
    class AdapterRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AdapterGeneratedTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_ESTIMATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    prompt_tokens_processed: int
    generated_tokens: int
    num_preemptions: int
    uptime_seconds: float
    kv_blocks_cached: int
    cached_prompt_tokens: int
    prefix_cache_hit_rate: float
    queue_wait_estimate_seconds: float
    step_seconds: float
    finished_per_second: float
    spec_proposed_tokens: int
    spec_accepted_tokens: int
    spec_mean_accepted_length: float
    adapter_requests: _containers.ScalarMap[str, int]
    adapter_generated_tokens: _containers.ScalarMap[str, int]
    pooling_requests: int
    pooling_tokens: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroupStats]
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    state_slots_total: int
    state_slots_used: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., prompt_tokens_processed: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., kv_blocks_cached: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., queue_wait_estimate_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., finished_per_second: _Optional[float] = ..., spec_proposed_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_mean_accepted_length: _Optional[float] = ..., adapter_requests: _Optional[_Mapping[str, int]] = ..., adapter_generated_tokens: _Optional[_Mapping[str, int]] = ..., pooling_requests: _Optional[int] = ..., pooling_tokens: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroupStats, _Mapping]]] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., state_slots_total: _Optional[int] = ..., state_slots_used: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class KVGroupStats(_message.Message):
    __slots__ = ("window", "num_layers", "blocks_used")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    window: int
    num_layers: int
    blocks_used: int
    def __init__(self, window: _Optional[int] = ..., num_layers: _Optional[int] = ..., blocks_used: _Optional[int] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "dimensions", "normalize", "truncate_prompt_tokens", "prompt_name", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    normalize: bool
    truncate_prompt_tokens: int
    prompt_name: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_name: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "prompt_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "query", "documents", "top_n", "truncate_prompt_tokens", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    truncate_prompt_tokens: int
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("results", "prompt_tokens")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    prompt_tokens: int
    def __init__(self, results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
