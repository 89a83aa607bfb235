"""Incremental detokenization, checked against transformers' own decode for both kinds of
tokenizer a supported model uses: byte-level BPE (GPT-2, Llama 3, Qwen2) and SentencePiece with
byte fallback (Llama 2, Mistral, Gemma), both built locally, on text with accents, CJK and emoji,
split between prompt and completion at every token, partial characters at both ends included."""
import pytest

from pagoda.engine.demo import build_byte_tokenizer
from pagoda.engine.detokenizer import IncrementalDetokenizer, TokenVocab
from sp_tokenizer import build_sentencepiece_tokenizer

TEXTS = ["café au lait", "Über Öl und Größe", "日本語のテキスト", "emoji 🎉🚀 and 👩‍👩‍👧", "mixed é漢🎉z",
         "Hello 🎉東京で寿司を食べる。", "The quick brown fox. Привет!"]


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tok(request, tmp_path_factory):
    if request.param == "byte-level":
        return build_byte_tokenizer()
    return build_sentencepiece_tokenizer(str(tmp_path_factory.mktemp("sp")))


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab(tok)


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def run(vocab, prompt, completion, read_every: int = 1) -> tuple[str, list[str]]:
    """The completion's text, and the text as read along the way (every `read_every` tokens)."""
    d = IncrementalDetokenizer(vocab, prompt)
    seen = []
    for n, t in enumerate(completion, 1):
        d.append(t)
        if n % read_every == 0:
            seen.append(d.text)
    return d.flush(), seen


@pytest.mark.parametrize("text", TEXTS)
def test_text_equals_transformers_decode_at_every_split(tok, vocab, text):
    """Prompt = the first k tokens, completion = the rest: the completion's text is decode(all)
    less decode(prompt). Where k falls inside a character (decode(prompt) has U+FFFD), the
    completion's text starts with that whole character: a suffix of decode(all), no U+FFFD."""
    ids = tok.encode(text)
    full = decode(tok, ids)
    assert full == text.lstrip() or full == text
    num_boundaries, previous = 0, full
    for k in range(1, len(ids)):
        got, seen = run(vocab, ids[:k], ids[k:])
        head = decode(tok, ids[:k])
        if "\ufffd" not in head:
            assert got == full[len(head):], k
            num_boundaries += 1
        assert full.endswith(got) and len(got) <= len(previous) and "\ufffd" not in got, k
        assert all(got.startswith(s) for s in seen)  # text once read is never taken back
        previous = got
    assert num_boundaries >= min(len(text.split()), len(ids) - 1) - 1


@pytest.mark.parametrize("text", TEXTS)
def test_reading_rarely_or_often_gives_the_same_text(vocab, tok, text):
    ids = tok.encode("prompt: " + text)
    k = len(tok.encode("prompt:"))
    texts = {run(vocab, ids[:k], ids[k:], every)[0] for every in (1, 2, 3, len(ids))}
    assert len(texts) == 1


def test_a_prompt_ending_in_an_emoji_keeps_a_completion_in_byte_tokens_whole(tok, vocab):
    """The case that went wrong: the prompt ends in an emoji, the completion spells CJK in byte tokens."""
    prompt, completion = tok.encode("Sushi 🎉"), tok.encode("🎉東京で寿司を食べる。")
    completion = completion[len(tok.encode("🎉")):] if decode(tok, completion[:len(tok.encode("🎉"))]) == "🎉" \
        else completion
    got, seen = run(vocab, prompt, completion)
    assert got.endswith("東京で寿司を食べる。") and "\ufffd" not in got
    assert got == decode(tok, prompt + completion)[len(decode(tok, prompt)):]


def byte_tokens(tok, data: bytes) -> list[int]:
    """Token ids that spell `data` byte by byte (whatever the bytes, well-formed or not)."""
    if "<0x41>" in tok.get_vocab():  # SentencePiece byte fallback
        return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])
    from pagoda.engine.detokenizer import byte_level_alphabet
    alphabet = byte_level_alphabet()
    return tok.convert_tokens_to_ids([alphabet[b] for b in data])


@pytest.mark.parametrize("data", [
    "東京".encode() + b"\xe6\x9d" + "寿司".encode(),  # a character cut short in the middle
    b"\xff" + "東京".encode(),  # a byte that is never UTF-8
    "ab".encode() + b"\xe6",  # incomplete at the very end
    b"\xf0\x9f\x8e" + "éA".encode(),  # an emoji missing its last byte
])
def test_only_bytes_that_form_no_character_become_u_fffd(tok, vocab, data):
    """Every character the completion's bytes form comes back as itself (a decoder that replaces a
    whole run of byte tokens would lose 東京 here); each ill-formed part is one U+FFFD, as Python's
    own UTF-8 decoder gives it."""
    got, seen = run(vocab, tok.encode("x:"), byte_tokens(tok, data))
    assert got == data.decode("utf-8", "replace")
    assert all(got.startswith(s) for s in seen)
    incomplete_tail = data.endswith(b"\xe6")
    assert all("\ufffd" not in s for s in seen) or not incomplete_tail  # the tail waits for its bytes


def test_special_tokens_add_no_text_and_a_bare_prompt_strips_like_decode(tok, vocab):
    bos = tok.bos_token_id
    ids = tok.encode(" Über das")
    got, _ = run(vocab, [bos], ids + [tok.eos_token_id])
    assert got == decode(tok, [bos] + ids)  # SentencePiece strips the leading space here, as decode does


def test_stop_string_trims_text(vocab, tok):
    d = IncrementalDetokenizer(vocab, tok.encode("x"))
    found = False
    for i in tok.encode("hello STOP world"):
        d.append(i)
        if d.find_stop(["STOP"]):
            found = True
            break
    assert found and d.text.strip() == "hello"


def test_ids_past_the_tokenizer_add_nothing(tok):
    """A model's padded vocabulary (embedding rows no token uses) decodes to nothing, as decode does."""
    vocab = TokenVocab(tok, vocab_size=len(tok) + 8)
    ids = tok.encode("a bc")
    got, _ = run(vocab, ids[:1], ids[1:] + [len(tok) + 3])
    assert got == decode(tok, ids)[len(decode(tok, ids[:1])):] and got


def test_special_tokens_kept_when_asked_as_decode_gives_them(tok, vocab):
    ids = tok.encode("Hello there") + [tok.eos_token_id] + tok.encode(" more") + [tok.bos_token_id]
    for k in (1, 3):
        d = IncrementalDetokenizer(vocab, ids[:k], skip_special_tokens=False)
        for t in ids[k:]:
            d.append(t)
        full, head = tok.decode(ids, skip_special_tokens=False), tok.decode(ids[:k], skip_special_tokens=False)
        assert d.flush() == full[len(head):] and tok.eos_token in d.text
        skipped, _ = run(vocab, ids[:k], ids[k:])
        assert tok.eos_token not in skipped


@pytest.mark.parametrize("include,want", [(False, "hello "), (True, "hello STOP")])
def test_the_stop_string_kept_when_asked(vocab, tok, include, want):
    d = IncrementalDetokenizer(vocab, tok.encode("x"))
    for i in tok.encode("hello STOP world and more"):
        d.append(i)
        if d.find_stop(["STOP", "never"], include=include):
            break
    assert d.text.lstrip() == want.lstrip()
