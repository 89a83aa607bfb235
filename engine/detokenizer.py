"""Incremental detokenization: text deltas that are always whole UTF-8 characters."""

# Decoding a window that starts a few tokens back lets tokenizers that merge spaces or
# byte pieces across tokens (SentencePiece, byte-level BPE) produce the right text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        # a fast tokenizer's Rust decoder directly: the Python wrapper costs more than the decoding
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._text = ""  # everything decoded so far (trimmed at a stop string)
        self._num_decoded = len(self.ids)  # ids taken into _text (or held back as incomplete)
        self._stop_checked = 0  # text before this index holds no stop string

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def text(self) -> str:
        """Everything decoded so far: tokens appended since the last read are decoded now, so
        that a consumer that reads the text only at the end pays for one decode, not one a token."""
        if self._num_decoded < len(self.ids):
            self._advance(final=False)
        return self._text

    def append(self, token_id: int) -> None:
        """Take one generated token; it is decoded when the text is next read."""
        self.ids.append(token_id)

    def add(self, token_id: int) -> str:
        """Take one generated token; return the new text it completes (maybe empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back (e.g. an incomplete UTF-8 sequence) is emitted."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        self._num_decoded = len(self.ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text += delta
        return delta

    def find_stop(self, stops: list[str]) -> bool:
        """Look for a stop string in the text not yet searched; on a hit, cut the text before it."""
        if not stops:
            return False
        text = self.text
        start = max(0, self._stop_checked - max(len(s) for s in stops) + 1)
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        self._stop_checked = len(text)
        if not hits:
            return False
        self._text = text[:min(hits)]
        return True
