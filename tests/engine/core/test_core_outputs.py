"""The core's output processor (engine/core/core_outputs.py) on its own: deltas with the stop-string
hold-back, whole outputs, a failed sequence; and the one finish-reason map both doors use."""
import pytest

from pagoda.engine.core.core_outputs import sendable_end, step_outputs
from pagoda.engine.outputs import FINISH_REASONS, RequestOutput, TokenLogprob, merge
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.sequence import Sequence, SequenceStatus
from pagoda.engine.outputs import FinishReason
from pagoda.server import convert
from pagoda.v1 import generation_pb2 as pb


class Detokenizer:
    """Each token id spells one character; flush() adds U+FFFD (an incomplete last character)."""

    def __init__(self, seq):
        self.seq, self.tail = seq, ""

    @property
    def text(self) -> str:
        return "".join(chr(t) for t in self.seq.generated_token_ids) + self.tail

    def flush(self) -> None:
        self.tail = "\ufffd"


def sequence(stream: bool = True, **params) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(**{"max_tokens": 100, **params}), stream=stream)
    seq.detokenizer = Detokenizer(seq)  # it reads the sequence it belongs to
    return seq


def generate(seq: Sequence, text: str) -> None:
    for c in text:
        seq.token_ids.append(ord(c))
        if seq.params.logprobs:
            seq.logprobs.append(TokenLogprob(ord(c), -1.0))


def finish(seq: Sequence, reason: FinishReason) -> None:
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


def test_deltas_hold_back_what_may_start_a_stop_string():
    seq = sequence(stop=["xyz"], logprobs=True)
    generate(seq, "abcde")
    [out] = step_outputs([seq])
    assert (out.text, out.token_ids, out.finished, out.finish_reason) == ("abc", [97, 98, 99, 100, 101], False, None)
    assert [lp.token_id for lp in out.logprobs] == [97, 98, 99, 100, 101]
    generate(seq, "f")
    [out] = step_outputs([seq])
    assert (out.text, out.token_ids, out.num_generated_tokens) == ("d", [102], 6)  # counts are cumulative
    finish(seq, FinishReason.LENGTH)
    [out] = step_outputs([seq])
    # at the end the held-back text goes out, with a flushed incomplete character
    assert (out.text, out.token_ids, out.finished) == ("ef\ufffd", [], True)
    assert (out.finish_reason, out.stop_reason, out.num_prompt_tokens) == ("length", "length", 3)


def test_a_stop_string_end_sends_what_is_left_without_a_flush():
    seq = sequence(stop=["xy"])
    generate(seq, "abc")
    assert step_outputs([seq])[0].text == "ab"
    finish(seq, FinishReason.STOP_STRING)
    [out] = step_outputs([seq])
    assert (out.text, out.finish_reason, out.stop_reason) == ("c", "stop", "stop_string")


def test_a_whole_output_request_gets_one_output_when_it_finishes():
    seq = sequence(stream=False, logprobs=True, prompt_logprobs=0)
    seq.prompt_logprobs = [TokenLogprob(2, -0.5), TokenLogprob(3, -0.25)]
    generate(seq, "ab")
    assert step_outputs([seq]) == []
    generate(seq, "c")
    finish(seq, FinishReason.EOS)
    [out] = step_outputs([seq])
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("abc\ufffd", [97, 98, 99], "stop", "eos")
    assert len(out.logprobs) == 3 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3


def test_deltas_merged_equal_the_whole_output():
    streamed, whole = sequence(stop=["zz"]), sequence(stream=False, stop=["zz"])
    outs = []
    for piece in ("ab", "c", "de"):
        for seq in (streamed, whole):
            generate(seq, piece)
        outs += step_outputs([streamed])
        assert step_outputs([whole]) == []
    for seq in (streamed, whole):
        finish(seq, FinishReason.STOP_TOKEN)
    outs += step_outputs([streamed])
    merged = outs[0]
    for out in outs[1:]:
        merged = merge(merged, out)
    [final] = step_outputs([whole])
    assert (merged.text, merged.token_ids, merged.finish_reason) == (final.text, final.token_ids, final.finish_reason)


def test_a_failed_sequence_reports_its_error():
    seq = sequence()
    generate(seq, "ab")
    finish(seq, FinishReason.ERROR)
    seq.error = "boom"
    [out] = step_outputs([seq])
    assert (out.finished, out.finish_reason, out.error, out.text) == (True, "error", "boom", "")


@pytest.mark.parametrize("length,num_sent,stop,end", [
    (10, 0, [], 10),  # no stop strings: everything
    (10, 0, ["abc"], 8),  # the last 2 characters may start "abc"
    (10, 0, ["a", "abcd"], 7),  # the longest stop string counts
    (2, 0, ["abcd"], 0),
    (10, 9, ["abcd"], 9),  # never less than what was already sent
])
def test_sendable_end(length, num_sent, stop, end):
    assert sendable_end(length, num_sent, stop) == end


@pytest.mark.parametrize("reason,openai,grpc", [
    (FinishReason.EOS, "stop", pb.FINISH_REASON_EOS), (FinishReason.STOP_TOKEN, "stop", pb.FINISH_REASON_STOP_TOKEN),
    (FinishReason.STOP_STRING, "stop", pb.FINISH_REASON_STOP_STRING),
    (FinishReason.GRAMMAR, "stop", pb.FINISH_REASON_GRAMMAR), (FinishReason.LENGTH, "length", pb.FINISH_REASON_LENGTH),
    (FinishReason.ABORT, "abort", pb.FINISH_REASON_ABORTED),
    (FinishReason.ERROR, "error", pb.FINISH_REASON_UNSPECIFIED),
    (FinishReason.TIME_LIMIT, "time_limit", pb.FINISH_REASON_TIME_LIMIT)])
def test_every_finish_reason_has_one_name_per_door(reason, openai, grpc):
    assert set(FINISH_REASONS) == {r.value for r in FinishReason} | {"tool_calls"}  # tool_calls: a door's
    seq = sequence()
    finish(seq, reason)
    [out] = step_outputs([seq])
    assert (out.finish_reason, out.stop_reason) == (openai, reason.value)  # the HTTP door's finish_reason
    assert convert.finish_reason(out) == grpc
    assert convert.finish_reason(RequestOutput("r", [], "")) == pb.FINISH_REASON_UNSPECIFIED
