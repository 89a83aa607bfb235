"""Incremental detokenization through each token's bytes, right for every tokenizer.

A tokenizer's decode works on strings, which goes wrong for text decoded a piece at a time: a
byte-fallback SentencePiece decoder turns a whole run of byte tokens into one U+FFFD per byte as
soon as one byte of the run is ill-formed, and the decode of a window of tokens is not always a
prefix of the decode of a longer one. Here each token id maps to the bytes it adds to the text
(TokenVocab, read once from the tokenizer's decoder), and one incremental UTF-8 decoder per
sequence turns those bytes into characters: every character the bytes form comes back whole, an
incomplete one waits for its last byte, and only bytes that form no character become U+FFFD.
"""
import codecs
import json
import logging
import re

log = logging.getLogger("pagoda.engine")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MIN_CONTEXT_BYTES = 4  # the longest UTF-8 character: enough prompt bytes to know where the next one starts


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: printable bytes stand for themselves, the
    others for the characters from 256 on (tokenizers' ByteLevel decoder reads it back)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class TokenVocab:
    """What each token id adds to decoded text, as bytes, with the tokenizer's decode rules:
    special tokens add nothing (decode's skip_special_tokens=True), ids past the tokenizer's
    vocabulary (a model's padded embedding rows) add nothing, and `strip_leading` spaces are
    dropped from the start of the text (SentencePiece's decoders strip the dummy prefix)."""

    def __init__(self, tokenizer, vocab_size: int = 0):
        steps = _decoder_steps(tokenizer)
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        special = set(tokenizer.all_special_ids) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        if steps is None:
            log.warning("the tokenizer's decoder is not one pagoda reads token by token; text is each "
                        "token's own decode and may differ from decoding the whole sequence")
            pieces = [tokenizer.decode([i]).encode() for i in range(len(tokens))]
            self.strip_leading = 0
        else:
            pieces = [_piece(t, steps) if t is not None else b"" for t in tokens]
            self.strip_leading = _strip_leading(steps)
        padding = [b""] * max(0, vocab_size - len(pieces))
        self.pieces_with_special: list[bytes] = pieces + padding  # decode(..., skip_special_tokens=False)
        pieces = list(pieces)
        for i in special:
            if i < len(pieces):
                pieces[i] = b""
        self.pieces: list[bytes] = pieces + padding

    def prompt_context(self, prompt_token_ids: list[int], pieces: list[bytes]) -> tuple[bytes, bool]:
        """The prompt's last bytes (enough for a character it leaves incomplete) and whether the
        prompt has any text at all (if not, the completion's start is stripped as decode would)."""
        tail, n = [], 0
        for t in reversed(prompt_token_ids):
            piece = pieces[t] if t < len(pieces) else b""
            tail.append(piece)
            n += len(piece)
            if n >= _MIN_CONTEXT_BYTES:
                break
        return b"".join(reversed(tail)), n > 0


def _decoder_steps(tokenizer) -> list[dict] | None:
    """The decoder's steps (tokenizers' JSON), or None when one of them is not per-token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder")
    if decoder is None:
        return None
    steps = decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]
    known = {"ByteLevel", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    for s in steps:
        if s["type"] not in known and not (s["type"] == "Replace" and "String" in s["pattern"]):
            return None
        if s["type"] == "Strip" and s.get("stop"):
            return None
    return steps


def _piece(token: str, steps: list[dict]) -> bytes:
    """One token's bytes through the decoder's per-token steps."""
    out: str | bytes = token
    for s in steps:
        if isinstance(out, bytes):
            break
        kind = s["type"]
        if kind == "Replace":
            out = out.replace(s["pattern"]["String"], s["content"])
        elif kind == "Metaspace":
            out = out.replace(s["replacement"], " ")
        elif kind == "ByteFallback" and (m := _BYTE_TOKEN.fullmatch(out)):
            out = bytes([int(m.group(1), 16)])
        elif kind == "ByteLevel":
            table = _byte_decoder()
            out = b"".join(bytes([table[c]]) if c in table else c.encode() for c in out)
    return out if isinstance(out, bytes) else out.encode()


def _strip_leading(steps: list[dict]) -> int:
    for s in steps:
        if s["type"] == "Strip" and s.get("content") == " ":
            return s.get("start", 0)
        if s["type"] == "Metaspace" and s.get("prepend_scheme", "always") != "never":
            return 1
    return 0


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    if not _BYTE_DECODER:
        _BYTE_DECODER.update({c: b for b, c in enumerate(byte_level_alphabet())})
    return _BYTE_DECODER


class IncrementalDetokenizer:
    """One sequence's text. Tokens are appended without decoding and decoded when the text is
    read, so a reader that looks only at the end pays once; text once read is never taken back
    (a stop string cuts only text not yet handed out, see core_outputs.sendable_end)."""

    def __init__(self, vocab: TokenVocab, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.pieces = vocab.pieces if skip_special_tokens else vocab.pieces_with_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        context, has_text = vocab.prompt_context(prompt_token_ids, self.pieces)
        self._utf8.decode(context)  # a character the prompt left incomplete continues here
        self._to_strip = 0 if has_text else vocab.strip_leading
        self._pending: list[int] = []
        self._text = ""
        self._stop_checked = 0  # text before this index holds no stop string

    def append(self, token_id: int) -> None:
        self._pending.append(token_id)

    @property
    def text(self) -> str:
        if self._pending:
            pieces = self.pieces
            data = b"".join([pieces[t] if t < len(pieces) else b"" for t in self._pending])
            self._pending.clear()
            if self._to_strip and data:
                data = self._strip(data)
            self._text += self._utf8.decode(data)
        return self._text

    def _strip(self, data: bytes) -> bytes:
        n = min(self._to_strip, len(data) - len(data.lstrip(b" ")))
        self._to_strip = 0 if len(data) > n else self._to_strip - n
        return data[n:]

    def flush(self) -> str:
        """At the end: the bytes of an incomplete last character become U+FFFD."""
        self._text = self.text + self._utf8.decode(b"", final=True)
        return self._text

    def find_stop(self, stops: list[str], include: bool = False) -> bool:
        """Look for a stop string in the text not yet searched; on a hit, cut the text before it (after
        it with `include`; the first one to start wins, the longest of those)."""
        text = self.text
        start = max(0, self._stop_checked - max(len(s) for s in stops) + 1)
        hits = [(i, -len(s)) for s in stops if (i := text.find(s, start)) >= 0]
        self._stop_checked = len(text)
        if not hits:
            return False
        at, minus_len = min(hits)
        self._text = text[:at - minus_len if include else at]
        return True
