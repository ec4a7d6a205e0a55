"""Text of generated tokens: incremental detokenizing for streams, stop-string search."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Detokenizer:
    """Incremental text of one row: decode a window of the last tokens and keep what it adds
    to the window's earlier text, held back while it ends in an incomplete character.

    Args:
        decode: token ids -> text (`Engine.decode`).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        delta = now[len(before) :]
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in `text` found at or after `start` (-1: none)."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
