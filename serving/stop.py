"""Stop sequences on streamed text: OpenAI's `stop`, and vLLM's `stop_token_ids`.

Text arrives a piece per token (the incremental detokenizer's output).  A stop string may span
pieces, so the tail of the text that could still become the start of a stop string is held back
until the next piece settles it; the client never sees a byte of a stop string, and text that
turns out not to be one is released unchanged (so the concatenated output equals the full text
cut before the first stop string).  `StopMatcher` is pure: the router feeds it and, on a match,
cancels the generation.
"""

from __future__ import annotations

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


class StopMatcher:
    """Feed text pieces; each `feed` returns (text safe to emit, stopped).  Once stopped, the
    emitted text is the generation cut before the earliest stop string; `flush` returns what
    is held back when the generation ends without a stop."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    @property
    def held(self) -> str:
        """The text held back (it may begin a stop string)."""
        return self._held

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
