"""Stop strings over streamed text: emit what is safe, hold back what could still become a stop string.

The matcher keeps a small buffer: the longest tail of the text seen so far that is a prefix of some
stop string. Nothing before that tail can be part of a stop, so it is emitted at once; the tail waits
until the next piece either completes a stop (the sequence finishes, the stop is never emitted) or
rules it out (the tail is released).

When several stops occur, the one that *completes* first wins, so the result does not depend on how
the text was split into pieces; among stops completing at the same character the longest wins, so no
part of a stop string ever reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not a single string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = tuple(dict.fromkeys(stop))  # deduplicated, in the caller's order
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def push(self, new_text: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string matched or None).

        After a match the caller finishes the sequence; pushing again is a programming error.
        """
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched; the sequence is finished")
        buffer = self._held + new_text
        match = self._first_completed_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched = stop
            return buffer[:start], stop
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """On finish without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_completed_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop): earliest end, then longest
        for stop in self.stop:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), -len(stop), stop)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, negative_length, stop = best
        return end + negative_length, stop

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._max_held), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0
