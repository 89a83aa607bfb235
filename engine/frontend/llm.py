"""The offline API, in the habit of vLLM users: LLM(model).generate(prompts, params), LLM.chat(messages)."""
import dataclasses
import sys

from tqdm import tqdm

from pagoda.engine.config import EngineConfig
from pagoda.engine.errors import EngineError, InvalidRequestError
from pagoda.engine.inputs import chat_prompt_ids, make_request
from pagoda.engine.openmp import waits_passively
from pagoda.engine.outputs import RequestOutput, full_output
from pagoda.engine.pooling import PoolingParams, with_prompt
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.validation import ModelLimits

PROGRESS_DELAY_S = 1.0  # use_tqdm=None: a bar only for a call that runs longer than this, on a terminal
ROLES = ("system", "developer", "user", "assistant", "tool")


class LLM:
    def __init__(self, model: str | None = None, **options):
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        # First, before torch loads (EngineConfig may load it to look at the device): its OpenMP runtime
        # reads the policy only then (engine/openmp.py). EngineCore is imported here for the same reason.
        waits_passively()
        from pagoda.engine.core.engine_core import EngineCore

        self.engine = EngineCore(EngineConfig(model=model, **options))
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        info = self.engine.model_info()
        self._model = ModelLimits.of(info)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | list[str | None] | None = None, *, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Completions of each prompt (text, token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}), in order; a bad prompt or option raises InvalidRequestError (a
        ValueError) naming it before anything runs. `adapter`: a LoRA adapter's name (from
        lora_modules) for every prompt, or a list of names (None: the base model) per prompt.
        `use_tqdm`: a progress bar on stderr (True: always; False: never; None: when stderr is a
        terminal and the call runs longer than about a second)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([_unwrap(p) for p in prompts], sampling_params, adapter, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             adapter: str | list[str | None] | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Answers to one conversation (a list of {"role", "content"} dicts) or to each of a list of
        conversations, in order, rendered through the model's chat template as vLLM's LLM.chat does:
        `tools` (OpenAI's function tools) and `chat_template_kwargs` go to the template. Content is a
        string or a list of {"type": "text", "text": ...} parts. A bad message raises InvalidRequestError
        naming it (e.g. `messages[0].role`; `messages[i][j].role` for the j-th message of the i-th
        conversation) before anything runs. The other arguments are generate's."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of messages (or of conversations)")
        one = isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            where = "messages" if one else f"messages[{i}]"
            checked = _conversation(where, conversation)
            try:
                prompts.append(chat_prompt_ids(self.tokenizer, checked, tools, chat_template_kwargs,
                                               add_generation_prompt))
            except InvalidRequestError as e:  # named within its conversation: name the conversation too
                raise e if one else e.renamed(e.field.replace("messages", where, 1)) from None
        return self._run(prompts, sampling_params, adapter, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
              prompt_name: str | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Pooled hidden states of each prompt (as generate takes them), in order, as vLLM's LLM.embed: each
        output's `embedding` is a float32 array. Needs runner "pooling" or "all" (a sentence-transformers
        checkpoint gets "pooling" by default). prompt_name: one of the model's prompts
        (config_sentence_transformers.json, e.g. "query"), put before each text prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = with_prompt([_unwrap(p) for p in prompts], self._model.pooler, prompt_name)
        return self._run(prompts, pooling_params or PoolingParams(), None, use_tqdm)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Register a PEFT adapter directory under `name` (needs lora_modules or allow_lora_loading)."""
        self.engine.add_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter (offline, nothing is in flight between generate calls)."""
        self.engine.remove_adapter(name)
        if name not in self.engine.finish_unloads():
            raise EngineError(f"lora adapter {name!r} still has requests in flight")

    def _run(self, prompts: list, sampling_params, adapter, use_tqdm) -> list[RequestOutput]:
        """Every prompt checked as a request before any runs, then all run to the end."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"adapter has {len(adapters)} entries for {len(prompts)} prompts")
        if use_tqdm not in (None, True, False):
            raise TypeError(f"use_tqdm must be True, False or None, got {use_tqdm!r}")
        for a in adapters:
            self.engine.check_adapter(a)
        requests = [dataclasses.replace(make_request(p, sp, model=self._model, tokenizer=self.tokenizer,
                                                     request_id=str(i), stream=False, grammars=self.engine.grammars),
                                        adapter=a)
                    for i, (p, sp, a) in enumerate(zip(prompts, params, adapters))]
        for req in requests:
            self.engine.add_request(req)
        finished: dict[str, list[RequestOutput]] = {req.request_id: [] for req in requests}
        left = {req.request_id: req.params.n for req in requests}  # completions still running, per request
        with progress_bar(len(requests), use_tqdm) as bar:
            while self.engine.has_work():
                for out in self.engine.step():
                    finished[out.request_id].append(out)
                    left[out.request_id] -= out.finished
                    if out.finished and not left[out.request_id]:
                        bar.update(1)
        failed = [o for outs in finished.values() for o in outs if o.finish_reason == "error"]
        if failed:
            raise EngineError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [full_output(req.prompt_token_ids, finished[req.request_id]) for req in requests]


def progress_bar(total: int, use_tqdm: bool | None) -> tqdm:
    """A bar of finished requests on stderr (as it is at the call: a test or a notebook may replace it).
    None: only on a terminal, and only once the call has run PROGRESS_DELAY_S, so quick calls print nothing."""
    stream = sys.stderr
    if use_tqdm is None:
        show = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        return tqdm(total=total, file=stream, disable=not show, delay=PROGRESS_DELAY_S, desc="Processed prompts",
                    unit="prompt", dynamic_ncols=True)
    return tqdm(total=total, file=stream, disable=not use_tqdm, desc="Processed prompts", unit="prompt",
                dynamic_ncols=True)


def _unwrap(prompt):
    """vLLM's prompt dicts (TextPrompt / TokensPrompt) as the text or ids they hold."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
        return next(iter(prompt.values()))
    raise InvalidRequestError("prompt", "as a dict must hold exactly one key, 'prompt' (text) or "
                                        f"'prompt_token_ids' (ids); got {sorted(map(str, prompt))}")


def _conversation(where: str, messages) -> list[dict]:
    """A conversation as the chat template takes it: each message checked, its content as one string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(where, "must be a non-empty list of messages")
    return [_message(f"{where}[{j}]", m) for j, m in enumerate(messages)]


def _message(where: str, m) -> dict:
    if not isinstance(m, dict):
        raise InvalidRequestError(where, f"must be a dict with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None and not (role == "assistant" and m.get("tool_calls")):
        raise InvalidRequestError(f"{where}.content", "is required (a string or a list of text parts)")
    return {**m, "content": _text_of(f"{where}.content", content)}


def _text_of(where: str, content) -> str:
    """A message's text: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise InvalidRequestError(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequestError(f"{where}[{j}]", 'must be {"type": "text", "text": STRING}: the models '
                                                       "pagoda serves take text")
        texts.append(part["text"])
    return "".join(texts)
