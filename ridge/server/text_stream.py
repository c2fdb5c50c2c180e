"""Incremental text that never shows a stop string, not even a part of one.

The engine cuts a finished sequence's text just before the first stop string, but while it
runs, its cumulative text may end in the first characters of a stop string that the next
token completes. Holding back the last (longest stop string - 1) characters until the
sequence finishes means a stream only ever shows text that the final answer keeps.
"""
from __future__ import annotations


class TextDelta:
    def __init__(self, stop_strings: list[str] | None = None):
        self.hold = max(map(len, stop_strings or []), default=1) - 1
        self.shown = 0

    def delta(self, text: str, finished: bool) -> str:
        """The new part of `text` (a sequence's cumulative text) that is safe to show."""
        upto = len(text) if finished else max(self.shown, len(text) - self.hold)
        if upto <= self.shown:
            return ""
        piece = text[self.shown:upto]
        self.shown = upto
        return piece
