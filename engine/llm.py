"""The offline API, in the habit of vLLM users: LLM(model).generate(prompts, params)."""
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine, full_output
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason


class LLM:
    def __init__(self, model: str | None = None, **options):
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        groups = [self.engine.make_sequences(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for seqs in groups:
            self.engine.add_sequences(seqs)
        while self.engine.has_work():
            self.engine.step()
        failed = [s for seqs in groups for s in seqs if s.finish_reason is FinishReason.ERROR]
        if failed:
            raise EngineError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [full_output(seqs) for seqs in groups]
