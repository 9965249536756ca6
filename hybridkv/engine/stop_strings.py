"""A request's stop strings, found in text read a few characters at a time.

The engine reads each new token's text and asks whether a stop string now
ends in it; a stream asks how much of the text's tail may still begin one.
Checking every stop string at every token costs the number of stop strings
per token (a list of 800,000 short strings added 0.36 s a token on the real
model). An Aho-Corasick automaton, built once per list of stop strings
(SamplingParams.stop_strings, in the caller's thread) and read-only after,
answers both at a cost per character read, whatever their number; a
reader keeps its own state (an int):

* a state is the longest tail of the text read so far that begins a stop
  string (a node of the stop strings' trie);
* reading a character follows the trie, or failure links to shorter such
  tails when the trie has no edge for it;
* each state knows the longest stop string that is a tail of it.

The cut is the same as `str.find`'s over all stop strings: where the stop
string that begins first begins (docs/server.md).

Memory: one node per character of the stop strings, in arrays. The trie's
nodes along one stop string are numbered one after another, so the edge
from node i to node i + 1 needs no map entry; only the first new node of
each stop string (where it leaves an earlier one) does.
"""

from __future__ import annotations

from array import array


class StopStrings:
    def __init__(self, stops=()):
        self.patterns = tuple(stops)
        label, parent, depth = ["\0"], [-1], [0]  # node 0: the root, the empty tail
        branch: dict[tuple[int, str], int] = {}
        self._label, self._parent, self._branch = label, parent, branch  # read by _child while building
        ends = set()
        for stop in self.patterns:
            node, k = 0, 0
            while k < len(stop) and (child := self._child(node, stop[k])) is not None:
                node, k = child, k + 1
            if k < len(stop):  # the rest: new nodes, one after another
                new, rest = len(label), len(stop) - k
                if node != new - 1:
                    branch[node, stop[k]] = new
                label.extend(stop[k:])
                parent.append(node)
                parent.extend(range(new, new + rest - 1))
                depth.extend(range(depth[node] + 1, depth[node] + 1 + rest))
                node = new + rest - 1
            ends.add(node)
        # Failure links and longest stop strings, shallow nodes first: a
        # node's failure is a shorter tail, whose links are known by then.
        # (The transition is feed's, inline: this loop runs once a node.)
        size = len(label)
        fail, longest = [0] * size, [0] * size
        for node in sorted(range(1, size), key=depth.__getitem__):
            up = parent[node]
            if up:
                c, f = label[node], fail[up]
                while True:
                    if f + 1 < size and parent[f + 1] == f and label[f + 1] == c:
                        fail[node] = f + 1
                        break
                    child = branch.get((f, c))
                    if child is not None or not f:
                        fail[node] = child or 0
                        break
                    f = fail[f]
            longest[node] = depth[node] if node in ends else longest[fail[node]]
        self._label = "".join(label)
        self._parent, self._depth = array("i", parent), array("i", depth)
        self._fail, self._longest = array("i", fail), array("i", longest)

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def _child(self, node: int, c: str) -> int | None:
        following = node + 1
        if following < len(self._label) and self._parent[following] == node and self._label[following] == c:
            return following
        return self._branch.get((node, c))

    def feed(self, state: int, text: str) -> tuple[int, int | None]:
        """Read `text` from `state` (0: nothing read yet). Returns the new
        state and where, relative to `text`'s start, the earliest stop
        string ending inside `text` begins (negative: in the text read
        before), or None if none ends there."""
        label, parent, branch, fail, longest = self._label, self._parent, self._branch, self._fail, self._longest
        size = len(label)
        found = None
        for i, c in enumerate(text):
            while True:
                following = state + 1  # _child, inline: this loop runs for every character generated
                if following < size and parent[following] == state and label[following] == c:
                    state = following
                    break
                child = branch.get((state, c))
                if child is not None:
                    state = child
                    break
                if not state:
                    break
                state = fail[state]
            if longest[state] and (found is None or i + 1 - longest[state] < found):
                found = i + 1 - longest[state]
        return state, found

    def held(self, state: int) -> int:
        """Characters at the end of the text read that may begin a stop
        string (a stream holds them back until the next token decides)."""
        return self._depth[state]

    def find(self, text: str) -> int:
        """Where the earliest stop string in `text` begins, or -1: the least
        `text.find(stop)` over the stop strings that occur."""
        found = self.feed(0, text)[1] if self.patterns else None
        return -1 if found is None else found
