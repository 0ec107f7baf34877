"""Bounded capture of a command's output: the first and last bytes, never all of it.

An output flood (`yes`, a 100 MB line) must not grow the service's memory, so output is streamed
through `CappedOutput`, which keeps at most `cap` bytes: the head, the tail, and a count of what
was dropped between them.
"""

from __future__ import annotations

from omniloop.sandboxes.base import TRUNCATION_MARKER


class CappedOutput:
    """Keeps the first `cap // 2` and the last `cap - cap // 2` bytes of a stream."""

    def __init__(self, cap: int) -> None:
        if cap < 2:
            raise ValueError(f"output cap must be at least 2 bytes, got {cap}")
        self.cap = cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        """True once more than `cap` bytes were fed."""
        return self.total > self.cap

    def feed(self, chunk: bytes) -> None:
        """Add the next chunk of the stream."""
        self.total += len(chunk)
        head_room = self.cap // 2 - len(self._head)
        if head_room > 0:
            self._head += chunk[:head_room]
            chunk = chunk[head_room:]
        if chunk:
            tail_cap = self.cap - self.cap // 2
            self._tail += chunk[-tail_cap:]
            del self._tail[:-tail_cap]

    def text(self) -> str:
        """The kept bytes as text (invalid UTF-8 replaced), with a marker where bytes were cut."""
        if not self.truncated:
            # Nothing was cut: one decode, so a character split between the two buffers stays
            # one character.
            return (bytes(self._head) + bytes(self._tail)).decode("utf-8", errors="replace")
        head = self._head.decode("utf-8", errors="replace")
        dropped = self.total - len(self._head) - len(self._tail)
        tail = self._tail.decode("utf-8", errors="replace")
        return head + TRUNCATION_MARKER.format(n=dropped) + tail
