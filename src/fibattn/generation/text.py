"""Text out of streamed tokens: an incremental detokenizer that never splits a character."""
from __future__ import annotations

import codecs


class TextStream:
    """Incremental detokenizer: ``push(token) -> str`` never splits a UTF-8 character.

    Byte tokenizers go through an incremental UTF-8 decoder; others re-decode a short
    tail of ids and emit the new text once it no longer ends in a partial character.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = getattr(tokenizer, "eos_id", None)
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") \
            if getattr(tokenizer, "name", "") == "byte" else None
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        if token == self.eos:
            return ""
        if self._bytes is not None:
            return self._bytes.decode(bytes([token]))
        self.ids.append(token)
        before = self.tok.decode(self.ids[self._prefix:self._read])
        text = self.tok.decode(self.ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        before = self.tok.decode(self.ids[self._prefix:self._read])
        return self.tok.decode(self.ids[self._prefix:])[len(before):]
