"""POST /v1/completions: one request per prompt, n choices each (choice index: prompt * n + index);
`echo` puts the prompt (and with logprobs its tokens' logprobs) before each choice's text."""
from __future__ import annotations

from functools import partial

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.answer import PLAIN
from pagoda.server.openai.logprobs import echoed
from pagoda.server.openai.protocol import CompletionRequest, sampling_params
from pagoda.server.http.serving import Call, Serving, usage


class Completions:
    def __init__(self, serving: Serving):
        self.serving = serving

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        return await self.serving.generate(body, request, "cmpl-", partial(self._requests, body),
                                           partial(_whole, body), partial(_chunks, body))

    def _requests(self, body: CompletionRequest, engine, rid: str) -> tuple:
        # echo with logprobs: the prompt's tokens come with theirs (the first one's null)
        echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        params = sampling_params(body, max_tokens, body.logprobs, prompt_logprobs=echo_logprobs)
        prompts = _prompts(body.prompt, _start_of_text(engine))
        self.serving.state.check_call_size(len(prompts), "prompt")
        several = isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list))
        reqs = []
        for i, p in enumerate(prompts):
            try:
                reqs.append(engine.make_request(p, params, f"{rid}-{i}", body.priority or 0,
                                                limits=self.serving.state.limits))
            except InvalidRequestError as e:  # the engine's prompt_token_ids[j] as this request spells it
                if not e.field.startswith("prompt"):
                    raise
                name = f"prompt[{i}]" if several else "prompt"
                raise e.renamed(name + e.field.removeprefix("prompt_token_ids").removeprefix("prompt")) from None
        return reqs, PLAIN


def _whole(body: CompletionRequest, call: Call, outs: list) -> dict:
    choices = [_choice(body, call, i, out, bool(body.echo), 0)[0] for i, out in outs]
    return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": usage(out for _, out in outs)}


async def _chunks(body: CompletionRequest, call: Call, outputs):
    """A chunk per delta (a choice's first also carries its echoed prompt), then usage if asked."""
    head = {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model}
    lasts, offsets = {}, {}  # per choice: its latest output; where its next logprob token starts in its text
    async for i, out in outputs:
        k = i * (body.n or 1) + out.index
        first = k not in lasts
        lasts[k] = out
        if out.text or out.finished or out.token_ids or first:
            choice, offsets[k] = _choice(body, call, i, out, bool(body.echo) and first, offsets.get(k, 0))
            yield {**head, "choices": [choice]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": usage(lasts.values())}


def _choice(body: CompletionRequest, call: Call, i: int, out, echo: bool, offset: int) -> tuple[dict, int]:
    """Prompt i's choice (whole, or a delta), after its prompt with `echo`; and where the choice's
    next logprob token starts in its text."""
    k, req = i * (body.n or 1) + out.index, call.reqs[i]
    prompt = call.engine.prompt_text(req) if echo else ""
    logprobs = None
    if out.logprobs is not None:
        items = echoed(req.prompt_token_ids if echo else None, out.prompt_logprobs) + out.logprobs
        logprobs, offset = call.logprobs.completion(items, offset)
    choice = {"index": k, "text": prompt + out.text, "finish_reason": out.finish_reason, "logprobs": logprobs}
    if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = call.logprobs.prompt(out.prompt_logprobs)
    if body.return_token_ids:
        choice["token_ids"] = out.token_ids
    return choice, offset


def _prompts(prompt, start_of_text: list[int]) -> list:
    """The request's prompts; null (or "") is OpenAI's default, a document boundary: here the model's
    start-of-text token (BOS, else EOS)."""
    if prompt is None or prompt == "":
        return [start_of_text]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    return list(prompt)


def _start_of_text(engine) -> list[int]:
    tok = engine.tokenizer
    token = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return [token] if token is not None else []
