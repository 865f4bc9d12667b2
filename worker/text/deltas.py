"""Text handed out in deltas: kept as the deltas, joined only when the whole is read."""

from __future__ import annotations


class DeltaText:
    """What every detokenizer shares: the deltas it has emitted, and their sum."""

    def __init__(self) -> None:
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        text = "".join(self._chunks)
        self._chunks = [text]
        return text

    def _keep(self, delta: str) -> str:
        """Record an emitted delta; returns it."""
        if delta:
            self._chunks.append(delta)
        return delta
