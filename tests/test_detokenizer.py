"""Incremental detokenization: whole UTF-8 in every delta, deltas add up to the full text."""
import pytest

from engine.demo import build_byte_tokenizer
from engine.detokenizer import IncrementalDetokenizer

TEXTS = ["café au lait", "naïve résumé", "日本語のテキスト", "emoji 🎉🚀 and 👩‍👩‍👧", "mixed é漢🎉z"]


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text), "multi-byte characters should span several byte tokens"
    d = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    deltas = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == text == d.text
    assert not any("\ufffd" in x for x in deltas)
    # a delta is empty exactly while a character is incomplete
    assert sum(1 for x in deltas if x) == len(text)


def test_flush_emits_an_incomplete_tail(tok):
    d = IncrementalDetokenizer(tok, [])
    ids = tok.encode("é")
    assert d.add(ids[0]) == ""
    assert d.flush() == "\ufffd"


def test_stop_string_trims_text(tok):
    d = IncrementalDetokenizer(tok, [])
    found = False
    for i in tok.encode("hello STOP world"):
        d.add(i)
        if d.find_stop(["STOP"]):
            found = True
            break
    assert found and d.text == "hello "


@pytest.mark.parametrize("text", TEXTS)
def test_appended_tokens_are_decoded_when_the_text_is_read(tok, text):
    """The engine appends tokens without decoding; reading .text at any point (every step, now
    and then, or only at the end) gives the same text as decoding token by token."""
    ids = tok.encode(text)
    for every in (1, 3, len(ids)):
        d = IncrementalDetokenizer(tok, tok.encode("prompt: "))
        seen = []
        for n, i in enumerate(ids, 1):
            d.append(i)
            if n % every == 0:
                seen.append(d.text)
        d.flush()
        assert d.text == text
        assert all(text.startswith(s) and "\ufffd" not in s for s in seen)
