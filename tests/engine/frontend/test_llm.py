"""The offline LLM (engine/frontend/llm.py): chat through the chat template, its refusals naming the
message, the progress bar (use_tqdm), and OpenMP's wait policy set before torch loads (engine/openmp.py)."""
import io
import os
import re
import subprocess
import sys

import pytest

from grpc_fixtures import REPO, tiny_checkpoint
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.openmp import waits_passively

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint(), dtype="float32", device="cpu", num_kv_blocks=64)


def test_chat_is_generate_on_the_rendered_conversation(llm):
    ids = llm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    (out,) = llm.chat(HELLO, GREEDY)
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    # content as text parts is the same conversation
    (parts,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
                        GREEDY)
    assert parts.prompt_token_ids == ids and parts.token_ids == out.token_ids


def test_chat_takes_a_list_of_conversations_and_the_template_options(llm):
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    outs = llm.chat([HELLO, other], [GREEDY, GREEDY], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.chat(c, GREEDY)[0].prompt_token_ids for c in (HELLO, other)]
    no_prompt = llm.chat(HELLO, GREEDY, add_generation_prompt=False)[0].prompt_token_ids
    assert outs[0].prompt_token_ids[:len(no_prompt)] == no_prompt and len(no_prompt) < len(outs[0].prompt_token_ids)


@pytest.mark.parametrize("messages, field", [
    ([{"role": "bot", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
    (["Hello"], "messages[0]"),
    ([], "messages"),
    ([HELLO, [{"role": "user", "content": "x"}, {"role": "nobody", "content": "y"}]], "messages[1][1].role"),
    ([HELLO, [{"role": "user", "content": "a\ud800"}]], "messages[1][0].content"),
])
def test_bad_messages_are_refused_naming_the_field(llm, messages, field):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY)
    assert e.value.field == field, e.value


def test_a_template_that_refuses_the_conversation_names_messages(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(HELLO, GREEDY, chat_template_kwargs={"chat_template": "{{ raise_exception('no') }}"})
    assert e.value.field == "messages" and "chat template" in str(e.value)


class _Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("use_tqdm, tty, shown", [(False, True, False), (True, False, True), (True, True, True),
                                                  (None, False, False)])
def test_the_progress_bar(llm, monkeypatch, use_tqdm, tty, shown):
    stream = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    outs = llm.generate(["a", "b", "c"], GREEDY, use_tqdm=use_tqdm)
    chats = llm.chat([HELLO, HELLO], GREEDY, use_tqdm=use_tqdm)
    assert len(outs) == 3 and len(chats) == 2
    written = stream.getvalue()
    assert ("Processed prompts" in written) == shown, written
    if shown:
        assert "3/3" in written and "2/2" in written


def test_the_automatic_bar_waits_for_a_terminal_and_a_second(llm, monkeypatch):
    # None: a bar only on a terminal, and tqdm's delay keeps a call shorter than PROGRESS_DELAY_S silent
    from pagoda.engine.frontend import llm as module
    from tqdm import tqdm

    made = []
    monkeypatch.setattr(module, "tqdm", lambda **kw: made.append(kw) or tqdm(**{**kw, "disable": True}))
    for tty in (True, False):
        monkeypatch.setattr(sys, "stderr", _Terminal(tty))
        llm.generate(["a"], GREEDY)
    assert [(kw["disable"], kw.get("delay")) for kw in made] == [(False, module.PROGRESS_DELAY_S),
                                                                 (True, module.PROGRESS_DELAY_S)]


def test_use_tqdm_takes_only_a_bool_or_none(llm):
    with pytest.raises(TypeError, match="use_tqdm"):
        llm.generate("a", GREEDY, use_tqdm="yes")


def test_waits_passively_unless_the_user_chose():
    for env, want in [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "300000"}, None)]:
        waits_passively(env)
        assert env.get("OMP_WAIT_POLICY") == want


SPIN_COUNTS = """
import sys
from pagoda import LLM
LLM(sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=16)
"""


def _spin_counts(env_extra: dict, torch_first: bool) -> set[str]:
    """The spin counts every OpenMP runtime in a fresh process read as it loaded (libgomp prints them with
    OMP_DISPLAY_ENV=VERBOSE; 0 is the passive policy, 300000 libgomp's spinning default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra, OMP_DISPLAY_ENV="VERBOSE")
    code = ("import torch\n" if torch_first else "") + SPIN_COUNTS
    out = subprocess.run([sys.executable, "-c", code, tiny_checkpoint()], capture_output=True, text=True, env=env,
                         timeout=300, cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    counts = set(re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr))
    assert counts, "no OpenMP runtime reported its settings:\n" + out.stderr[-2000:]
    return counts


def test_llm_sets_the_passive_policy_before_openmp_starts():
    assert _spin_counts({}, torch_first=False) == {"0"}
    # a user's own choice stands; and torch loaded before pagoda keeps libgomp's default (documented)
    assert _spin_counts({"OMP_WAIT_POLICY": "ACTIVE"}, torch_first=False) != {"0"}
    assert _spin_counts({}, torch_first=True) != {"0"}
