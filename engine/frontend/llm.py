"""The offline API, in the habit of vLLM users: LLM(model).generate(prompts, params)."""
import dataclasses

from pagoda.engine.config import EngineConfig
from pagoda.engine.errors import EngineError, InvalidRequestError
from pagoda.engine.core.engine_core import EngineCore
from pagoda.engine.outputs import full_output
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.inputs import make_request
from pagoda.engine.validation import ModelLimits


class LLM:
    def __init__(self, model: str | None = None, **options):
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.engine = EngineCore(EngineConfig(model=model, **options))
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        info = self.engine.model_info()
        self._model = ModelLimits(info.vocab_size, info.max_model_len)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Completions of each prompt (text, token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}), in order; a bad prompt or option raises InvalidRequestError (a
        ValueError) naming it before anything runs. `adapter`: a LoRA adapter's name (from
        lora_modules) for every prompt, or a list of names (None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_unwrap(p) for p in prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"adapter has {len(adapters)} entries for {len(prompts)} prompts")
        for a in adapters:
            self.engine.check_adapter(a)
        requests = [dataclasses.replace(make_request(p, sp, model=self._model, tokenizer=self.tokenizer,
                                                     request_id=str(i), stream=False, grammars=self.engine.grammars),
                                        adapter=a)
                    for i, (p, sp, a) in enumerate(zip(prompts, params, adapters))]  # all checked before any runs
        for req in requests:
            self.engine.add_request(req)
        finished: dict[str, list[RequestOutput]] = {req.request_id: [] for req in requests}
        while self.engine.has_work():
            for out in self.engine.step():
                finished[out.request_id].append(out)
        failed = [o for outs in finished.values() for o in outs if o.finish_reason == "error"]
        if failed:
            raise EngineError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [full_output(req.prompt_token_ids, finished[req.request_id]) for req in requests]

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Register a PEFT adapter directory under `name` (needs lora_modules or allow_lora_loading)."""
        self.engine.add_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter (offline, nothing is in flight between generate calls)."""
        self.engine.remove_adapter(name)
        if name not in self.engine.finish_unloads():
            raise EngineError(f"lora adapter {name!r} still has requests in flight")


def _unwrap(prompt):
    """vLLM's prompt dicts (TextPrompt / TokensPrompt) as the text or ids they hold."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
        return next(iter(prompt.values()))
    raise InvalidRequestError("prompt", "as a dict must hold exactly one key, 'prompt' (text) or "
                                        f"'prompt_token_ids' (ids); got {sorted(map(str, prompt))}")
