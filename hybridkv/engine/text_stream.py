"""Text deltas of one growing sequence of token ids, for streaming.

The engine decodes a sequence's text when it finishes; a stream needs text
as tokens arrive: the engine's incremental detokenizer
(engine/detokenizer.py) gives it, work per new token.

Stop strings are found by the engine, which cuts the final text before them;
a stream must never have sent what the cut removes. So the tail of the text
that could be the start of a stop string is held back until the next token
decides it. The request's stop-string automaton (stop_strings.py) reads the
new text only and knows that tail: work per new character, whatever the
number of stop strings.
"""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStrings


class TextStream:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: StopStrings | list[str] | None = None):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        # SamplingParams.stop_strings (built off the engine thread), or a list to build one from
        self.stops = stop if isinstance(stop, StopStrings) else StopStrings(stop or ())
        self.state = 0  # where the automaton stands after `text`
        self.cut: int | None = None  # where the earliest stop string in `text` begins, once one does
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
        new = self.detokenizer.update(token_ids)
        if new and self.stops and self.cut is None:
            self.state, found = self.stops.feed(self.state, new)
            if found is not None:
                self.cut = len(self.text) - len(new) + found
        # Text before a stop string is final; otherwise hold back the tail that may begin one.
        safe = self.cut if self.cut is not None else len(self.text) - self.stops.held(self.state)
        delta = self.text[self.sent:safe]
        self.sent = max(self.sent, safe)
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at a stop string)."""
        self.finished = True
        found = self.stops.find(final_text)
        if found >= 0:
            final_text = final_text[:found]
        sent = self.text[:self.sent]
        # Incremental and whole-output decoding agree on every tokenizer we
        # serve; if one ever does not, send nothing rather than repeat text.
        return final_text[len(sent):] if final_text.startswith(sent) else ""
