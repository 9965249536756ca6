"""Text deltas of one growing sequence of token ids, for streaming.

The engine decodes a sequence's text when it finishes; a stream needs text
as tokens arrive: the engine's incremental detokenizer
(engine/detokenizer.py) gives it, work per new token.

Stop strings are found by the engine, which cuts the final text before them;
a stream must never have sent what the cut removes. So the tail of the text
that could be the start of a stop string is held back until the next token
decides it.
"""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` up to the earliest stop string in it."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(found)] if found else text


class TextStream:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = list(stop or [])
        self.sent = 0  # characters of `text` already handed out
        self.finished = False

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def push(self, token_ids) -> str:
        """`token_ids`: the whole output so far. Returns the text that is safe
        to send now (possibly empty)."""
        if self.tokenizer is None or self.finished:
            return ""
        self.detokenizer.update(token_ids)
        safe = len(cut_at_stop(self.text, self.stop)) - self._stop_prefix_len()
        delta = self.text[self.sent:safe]
        self.sent = max(self.sent, safe)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that begins a stop string."""
        for k in range(min(max((len(s) for s in self.stop), default=1) - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at a stop string)."""
        self.finished = True
        final_text = cut_at_stop(final_text, self.stop)
        sent = self.text[:self.sent]
        # Incremental and whole-output decoding agree on every tokenizer we
        # serve; if one ever does not, send nothing rather than repeat text.
        return final_text[len(sent):] if final_text.startswith(sent) else ""
