"""Stop strings over streamed text: release only text that cannot be the start of a stop string.

Per generated token the engine does::

    result = checker.feed(detokenizer.add(token_id))
    stream(result.text)
    if result.stopped: finish the request with finish_reason "stop", stop_reason result.matched

and when the request ends for another reason (EOS, stop token, max_tokens)::

    result = checker.feed(detokenizer.finish())
    stream(result.text + ("" if result.stopped else checker.flush()))

The output never contains a stop string (unless `include_stop_str_in_output`), matches may span
any number of deltas, and the result does not depend on how the text was split into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StopOutput:
    text: str  # safe to stream now
    matched: str | None  # the stop string that ended generation; None while it goes on

    @property
    def stopped(self) -> bool:
        return self.matched is not None


class StopChecker:
    """Finds the first stop string in a stream of text deltas.

    The first stop string to complete (earliest end; the longest on a tie) wins, and the text is
    cut right before it (`include_stop_str_in_output`: right after it). Until then, the longest
    suffix that is a proper prefix of some stop string is held back; it is the only text a
    later match can start in, so each call searches just that suffix plus the new delta.
    """

    def __init__(self, stop: list[str], *, include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = list(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._tail = ""  # the suffix that may start a stop string (already released if include)
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        return self._matched

    def feed(self, delta: str) -> StopOutput:
        """Takes the next piece of text; returns what may be streamed now. After a match,
        further calls return empty text."""
        if self._matched is not None:
            return StopOutput("", self._matched)
        if not self._stop:
            return StopOutput(delta, None)
        window = self._tail + delta
        released = len(self._tail) if self._include else 0  # window[:released] already out
        match = self._first_match(window, len(self._tail))
        if match is not None:
            start, stop = match
            self._matched = stop
            self._tail = ""
            end = start + len(stop) if self._include else start
            return StopOutput(window[released:end], stop)
        keep = self._partial_match_length(window)
        self._tail = window[len(window) - keep :] if keep else ""
        if self._include:
            return StopOutput(window[released:], None)
        return StopOutput(window[: len(window) - keep], None)

    def flush(self) -> str:
        """At the end of generation: the held-back text (empty after a match)."""
        if self._matched is not None or self._include:
            self._tail = ""
            return ""
        tail, self._tail = self._tail, ""
        return tail

    def _first_match(self, window: str, old: int) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first among those ending after
        window[:old]; None if there is none."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop:
            start = window.find(stop, max(0, old - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _partial_match_length(self, window: str) -> int:
        """Length of the longest suffix of window that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            # Candidate starts: occurrences of stop[0] among the last len(stop) - 1 characters,
            # earliest first (the earliest that fits is the longest suffix for this stop).
            start = window.find(stop[0], max(0, len(window) - len(stop) + 1))
            while start >= 0 and len(window) - start > longest:
                if stop.startswith(window[start:]):
                    longest = len(window) - start
                    break
                start = window.find(stop[0], start + 1)
        return longest
