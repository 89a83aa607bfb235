"""A user's prompt (text or token ids) and SamplingParams as a checked EngineRequest, ready for the
core: the request's sizes against the server's limits, the prompt tokenized and checked, max_tokens
resolved against the context, bad words tokenized, the structured output compiled. The rules
themselves are engine/validation.py's."""
import time

from pagoda.engine.core.core_io import EngineRequest
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.pooling import NO_GENERATION, NO_POOLING, PoolingParams
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.validation import (DEFAULT_LIMITS, ModelLimits, RequestLimits, is_int, check_messages, check_request_id,
                                      check_text, new_request_id)


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> list[int]:
    """A conversation's prompt token ids, through the model's chat template: tools (OpenAI's function
    tools, as the caller sent them) go to the template's `tools` argument, template_kwargs to the
    template. What the template refuses (no template, a role it does not know) is the request's fault:
    InvalidRequestError naming `messages`."""
    check_messages(messages)  # the tokenizer's TypeError on a lone surrogate names nothing
    kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    except Exception as e:
        raise InvalidRequestError("messages", f"cannot be rendered with the model's chat template: {e}") from e
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if not ids:
        raise InvalidRequestError("messages", "rendered to an empty prompt")
    return ids


def make_request(prompt, params, *, model: ModelLimits, tokenizer, request_id: str | None = None,
                 priority: int = 0, limits: RequestLimits = DEFAULT_LIMITS, default_max_tokens: int | None = None,
                 stream: bool = True, grammars=None) -> EngineRequest:
    """A user's prompt (text or token ids) and SamplingParams as a checked EngineRequest: sizes
    first (so a huge request is refused before any tokenizing), then the prompt, then max_tokens
    against the context, then the structured output, compiled by `grammars` (a GrammarCompiler:
    this waits for it, so callers on an event loop run this in a thread when there is one).
    params.max_tokens None means default_max_tokens, else up to the context."""
    params = params if params is not None else SamplingParams()
    pooling = params if isinstance(params, PoolingParams) else None
    if pooling is not None:  # a prefill that never decodes: no token sampled
        params = SamplingParams(max_tokens=0, truncate_prompt_tokens=pooling.truncate_prompt_tokens)
        pooling = _check_pooling(pooling, model)
    elif model.runner == "pooling":
        raise InvalidRequestError("model", NO_GENERATION)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
    request_id = check_request_id(request_id) if request_id else new_request_id()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("priority", f"must be an integer, got {priority!r}")
    _check_stop_sizes(params, limits, model.vocab_size)
    ids = _prompt_ids(prompt, tokenizer, model, limits, params.truncate_prompt_tokens, pooling is not None)
    max_tokens = _max_tokens(params, len(ids), model.max_model_len, limits, default_max_tokens)
    if params.min_tokens > max_tokens:
        raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}")
    if max_tokens != params.max_tokens:
        params = params.replace(max_tokens=max_tokens)
    bad = bad_words_token_ids(params.bad_words, tokenizer)
    text = prompt if isinstance(prompt, str) and not params.truncate_prompt_tokens else None
    grammar, compile_s = None, None
    if params.structured_outputs is not None:
        if grammars is None:
            raise InvalidRequestError("structured_outputs", "are not available here (no grammar compiler)")
        t0 = time.monotonic()
        grammar = grammars.compile(params.structured_outputs, limits.max_grammar_bytes, limits.grammar_compile_timeout)
        compile_s = time.monotonic() - t0
    return EngineRequest(request_id, ids, params, priority, stream, bad_words_token_ids=bad, prompt_text=text,
                         grammar_compile_s=compile_s,
                         grammar=grammar, pooling=pooling)


def _check_pooling(pooling: PoolingParams, model: ModelLimits) -> PoolingParams:
    """A pooling request's params, the model's defaults filled in, if the model serves pooling."""
    if model.runner == "generate" or model.pooler is None:
        raise InvalidRequestError("model", NO_POOLING)
    for i, t in enumerate(pooling.logit_token_ids or ()):
        if not is_int(t) or not 0 <= t < model.vocab_size:
            raise InvalidRequestError(f"logit_token_ids[{i}]",
                                      f"must be a token id in [0, {model.vocab_size}), got {t!r}")
    return pooling.resolved(model.pooler, model.hidden_size)


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word's token ids, spelled alone and after a space (as it would follow another word):
    the sampler bans a sequence's next token where it would complete one of them."""
    out: list[list[int]] = []
    for word in words:
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(spelling, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def _check_stop_sizes(params, limits: RequestLimits, vocab_size: int) -> None:
    if limits.max_stop_strings is not None and len(params.stop) > limits.max_stop_strings:
        raise InvalidRequestError("stop", f"must hold at most {limits.max_stop_strings} strings "
                                          f"(--max-stop-strings), got {len(params.stop)}")
    for i, s in enumerate(params.stop):
        if limits.max_stop_string_len is not None and len(s) > limits.max_stop_string_len:
            raise InvalidRequestError(f"stop[{i}]", f"must be at most {limits.max_stop_string_len} characters "
                                                    f"(--max-stop-string-len), got {len(s)}")
    if limits.max_stop_token_ids is not None and len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError("stop_token_ids", f"must hold at most {limits.max_stop_token_ids} ids "
                                                    f"(--max-stop-token-ids), got {len(params.stop_token_ids)}")
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            raise InvalidRequestError(f"stop_token_ids[{i}]", f"must be < vocab_size ({vocab_size}), got {t}")
    for t in params.logit_bias:
        if t >= vocab_size:
            raise InvalidRequestError("logit_bias", f"token ids must be < vocab_size ({vocab_size}), got {t}")


def _prompt_ids(prompt, tokenizer, model: ModelLimits, limits: RequestLimits, keep_last: int | None,
                whole: bool = False) -> list[int]:
    """The prompt's token ids, checked; `keep_last` (truncate_prompt_tokens) keeps a longer one's tail.
    whole: a pooling request's, which may fill the context (no completion follows)."""
    most = limits.prompt_tokens(model.max_model_len + whole)
    flag = "--max-prompt-tokens, and " if limits.max_prompt_tokens is not None else ""
    why = "" if whole else " less one for the completion"
    too_long = f"more than the {most} prompt tokens accepted ({flag}the context length {model.max_model_len}{why})"
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        ids = tokenizer.encode(check_text("prompt", prompt))
        ids = ids[-keep_last:] if keep_last else ids
        if len(ids) > most:
            raise InvalidRequestError("prompt", f"is {len(ids)} tokens, {too_long}")
        return ids
    if prompt is None or isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__"):
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise InvalidRequestError("prompt_token_ids", "must not be empty")
    ids = ids[-keep_last:] if keep_last else ids
    if len(ids) > most:  # before the per-id check: a huge list is refused at once
        raise InvalidRequestError("prompt_token_ids", f"is {len(ids)} tokens, {too_long}")
    vocab = model.vocab_size
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab:
            raise InvalidRequestError(f"prompt_token_ids[{i}]", f"must be a token id in [0, {vocab}), got {t!r}")
    return ids


def _max_tokens(params, num_prompt: int, context: int, limits: RequestLimits, default: int | None) -> int:
    room = context - num_prompt
    most = limits.max_tokens(context)
    if params.max_tokens is None:
        return min(room, most) if default is None else min(default, room, most)
    if params.max_tokens > room:
        raise InvalidRequestError("max_tokens", f"({params.max_tokens}) plus the prompt ({num_prompt} tokens) "
                                                f"must fit the context length ({context})")
    if params.max_tokens > most:
        raise InvalidRequestError("max_tokens", f"must be at most {most} (this server's --max-tokens-limit), "
                                                f"got {params.max_tokens}")
    return params.max_tokens
