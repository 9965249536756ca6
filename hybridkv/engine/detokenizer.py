"""Text of a growing list of token ids, decoded a few tokens at a time.

Decoding "the new token" alone is wrong twice over: a character may span
several byte-level tokens (the first ones decode to U+FFFD), and some
tokenizers decode a token differently at the start of a text than after
others. So each update decodes a short window of recent tokens with and
without the new ones and keeps the difference: work per update stays
proportional to the new tokens, not to the whole output. The engine uses it
for stop strings, the server for streamed text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what an incomplete multi-byte character decodes to


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # decoded so far, complete characters only
        self._prefix = 0  # the window starts here (tokens already in `text`, for context)
        self._read = 0  # tokens up to here are in `text`

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids, start: int = 0) -> str:
        """The text that `token_ids[start:]` (the output so far) adds since
        the last update (empty while a character is incomplete)."""
        count = len(token_ids) - start
        if count <= self._read:
            return ""
        window = token_ids[start + self._prefix:start + count]
        before = self._decode(window[:self._read - self._prefix])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        new = after[len(before):]
        self.text += new
        self._prefix, self._read = self._read, count
        return new
