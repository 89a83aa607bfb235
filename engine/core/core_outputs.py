"""The one place RequestOutputs are made, in the engine core (its thread or its child process),
from the sequences a step touched: the offline API, both transports of the asyncio front-end and so
every door get the same text, the same hold-back and the same counts. The front-end only merges
them (engine/outputs.py merge) and routes them.

A streamed request gets, per step and per sequence, what is new since its last output; text that
may still turn out to be the start of a stop string is held back until it cannot (so a stream never
sends what a stop string later cuts). A request that is not streamed gets one output per sequence,
when it finishes, and its text is decoded once."""
from pagoda.engine.outputs import FINISH_REASONS, RequestOutput
from pagoda.engine.core.sequence import Sequence
from pagoda.engine.outputs import FinishReason

# a finished completion's incomplete last character is flushed as U+FFFD; not at a stop string
# (the text was cut before it), an abort or an error
_FLUSHED = (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.GRAMMAR,
            FinishReason.TIME_LIMIT)


def step_outputs(seqs: list[Sequence]) -> list[RequestOutput]:
    return [_output(s) for s in seqs if s.stream or s.is_finished]


def failed_output(request_id: str, error: str, index: int = 0, stop_reason: str = "error",
                  metrics=None) -> RequestOutput:
    """What a request's caller gets when the step running it failed (the stream raises EngineError), or
    the queue refused it (stop_reason "refused": QueueWaitError)."""
    return RequestOutput(request_id, [], "", finished=True, finish_reason="error", stop_reason=stop_reason,
                         error=error, index=index, metrics=metrics)


def _output(seq: Sequence) -> RequestOutput:
    reason = seq.finish_reason
    public = FINISH_REASONS[reason.value].openai if reason else None
    if reason is FinishReason.ERROR or reason is FinishReason.REFUSED:
        return failed_output(seq.request_id, seq.error, seq.index, reason.value, seq.times.metrics())
    if reason in _FLUSHED:
        seq.detokenizer.flush()
    text = seq.detokenizer.text
    end = len(text) if reason is not None else sendable_end(len(text), seq.num_text_sent, seq.params.stop)
    sent, num_generated = seq.num_tokens_sent, seq.num_generated_tokens
    out = RequestOutput(
        request_id=seq.request_id, index=seq.index, token_ids=seq.token_ids[seq.num_prompt_tokens + sent:],
        text=text[seq.num_text_sent:end], finished=reason is not None,
        finish_reason=public, stop_reason=reason.value if reason else None,
        num_prompt_tokens=seq.num_prompt_tokens, num_generated_tokens=num_generated,
        num_cached_tokens=seq.num_cached_tokens, metrics=seq.times.metrics(),
        logprobs=seq.logprobs[sent:num_generated] if seq.params.logprobs else None,
        prompt_logprobs=[None, *seq.prompt_logprobs] if seq.params.prompt_logprobs is not None and not sent else None,
        embedding=seq.embedding)
    seq.num_text_sent, seq.num_tokens_sent = end, num_generated
    return out


def sendable_end(length: int, num_sent: int, stop: list[str]) -> int:
    """How much of an unfinished stream's text can go out: all but what may yet be the start of a
    stop string (never less than what was already sent)."""
    return max(num_sent, length - max(map(len, stop), default=1) + 1)
