"""Stop strings: the automaton (engine/stop_strings.py) gives the cut of
`str.find` over every stop string, reading text a few characters at a time,
and a stream holds back exactly the tail that may begin one."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import SamplingParams
from hybridkv.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from hybridkv.engine.stop_strings import StopStrings
from hybridkv.engine.text_stream import TextStream

# A small alphabet: stop strings overlap, share prefixes and nest often.
stops_strategy = st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=8)
chunks_strategy = st.lists(st.text("abc", max_size=5), max_size=30)


def earliest(text: str, stops) -> int:
    """The rule: where the stop string that begins first begins, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=-1)


def held_back(text: str, stops) -> int:
    """The rule: the longest tail of `text` that begins a stop string."""
    for k in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@settings(max_examples=1500, deadline=None)
@given(stops=stops_strategy, chunks=chunks_strategy)
def test_fed_in_chunks_the_first_match_is_cut_where_str_find_cuts(stops, chunks):
    matcher, state, text = StopStrings(stops), 0, ""
    for chunk in chunks:
        state, found = matcher.feed(state, chunk)
        text += chunk
        expected = earliest(text, stops)
        if found is not None:  # the first stop string ends in this chunk: cut as str.find does
            assert len(text) - len(chunk) + found == expected
            break
        assert expected == -1
        assert matcher.held(state) == held_back(text, stops)
    assert matcher.find(text) == earliest(text, stops)


@settings(max_examples=500, deadline=None)
@given(stops=stops_strategy, text=st.text("abc", max_size=40))
def test_find_is_the_least_str_find(stops, text):
    assert StopStrings(stops).find(text) == earliest(text, stops)


class CharTokenizer:
    """One token a character: token id = code point."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@settings(max_examples=500, deadline=None)
@given(stops=stops_strategy, chunks=chunks_strategy)
def test_a_stream_sends_only_text_no_stop_string_can_take_back(stops, chunks):
    stream, ids, sent = TextStream(CharTokenizer(), stop=stops), [], ""
    final = None
    for chunk in chunks:
        ids += map(ord, chunk)
        text = "".join(map(chr, ids))
        if earliest(text, stops) >= 0:  # the engine finishes the sequence here, its text cut
            final = text[:earliest(text, stops)]
            break
        sent += stream.push(ids)
        assert sent == text[:len(text) - held_back(text, stops)]
    if final is None:
        final = "".join(map(chr, ids))
    assert sent + stream.finish(final) == final


def test_stop_bounds_are_value_errors_naming_the_bound():
    SamplingParams(stop=["x" * 256] * MAX_STOP_STRINGS)  # at the bounds: fine
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings; got {MAX_STOP_STRINGS + 1}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS // 2 + 1)] * 2)


def test_reading_costs_the_same_for_one_stop_string_or_the_most_allowed():
    # Per character read, not per stop string: 256 stop strings of 256
    # characters (the bounds) against one, on text that keeps entering them.
    many = StopStrings([f"{i:03d}" * 85 + "!" for i in range(MAX_STOP_STRINGS)])
    one = StopStrings(["012" * 85 + "!"])
    text = "".join(f"{i % 256:03d}" for i in range(20_000))

    def seconds(matcher):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            state = 0
            for k in range(0, len(text), 4):  # a token's few characters at a time
                state, found = matcher.feed(state, text[k:k + 4])
                assert found is None
            best = min(best, time.perf_counter() - started)
        return best

    assert seconds(many) < 3 * seconds(one), (seconds(many), seconds(one))
