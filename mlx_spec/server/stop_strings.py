"""Streamed text -> the part that may be sent, cut before the first stop string.

Text that could still grow into a stop string (a suffix that is a prefix of
one) is held back until the next piece decides it, so no part of a stop
string is ever sent, whichever tokens it falls across.
"""

from __future__ import annotations

from typing import Sequence, Tuple


class StopMatcher:
    """Feed text pieces; get back what to send and whether a stop string was reached."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # text not sent yet: it may begin a stop string

    def feed(self, text: str) -> Tuple[str, bool]:
        """(text to send now, True once a stop string is complete: send nothing more)."""
        if not self.stops:
            return text, False
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[:min(found)], ""
            return out, True
        held = self._held_back()
        out, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return out, False

    def flush(self) -> str:
        """What was held back, once generation ended without completing a stop string."""
        out, self.pending = self.pending, ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that begins a stop string."""
        for size in range(min(len(self.pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
