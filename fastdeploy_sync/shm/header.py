"""The words that say what a segment is and that it is ready: one rule for every layout.

Every segment this package lays out starts the same way: word 0 holds the layout's MAGIC,
word 1 the creator's pid (``segment.OWNER_PID``), then the layout's own fields (its
VERSION among them, unless the MAGIC carries it), and a READY word, 1 once the creator
has written everything a reader may read first. The creator writes READY last, with a
release store; a reader loads READY with an acquire load, then reads the rest: a reader
that sees READY == 1 sees every field as the creator wrote it, on any architecture
(``order``). ``SegmentHeader`` holds one layout's MAGIC, VERSION and READY positions and both
halves of that rule; the layouts (ring, pool, ack board, TP group, sealed anchor) keep
their own field positions beside it.
"""

from typing import Optional

from .order import load_acquire, store_release

__all__ = ["SegmentHeader", "MAGIC_AT"]

MAGIC_AT = 0


class SegmentHeader:
    """One layout's identity: ``magic`` at word 0, ``version`` at word ``version_at`` (no
    word when ``version_at`` is None: the magic carries the layout), READY at ``ready_at``.
    Holds no memory: its methods take the segment's int64 words (a memoryview, or the
    words read from a file)."""

    __slots__ = ("magic", "version", "version_at", "ready_at")

    def __init__(self, magic: int, ready_at: int, version: int = 0,
                 version_at: Optional[int] = None) -> None:
        self.magic, self.ready_at = magic, ready_at
        self.version, self.version_at = version, version_at

    def publish(self, words, fields: dict) -> None:
        """Write ``fields`` ({word: value}), MAGIC and VERSION, then READY = 1 with a
        release store: the last write, so that a reader that sees it sees the rest. Never
        blocks."""
        for index, value in fields.items():
            words[index] = value
        if self.version_at is not None:
            words[self.version_at] = self.version
        words[MAGIC_AT] = self.magic
        store_release(words, self.ready_at, 1)

    def ready(self, words) -> bool:
        """True if ``words`` hold a READY segment of this layout (MAGIC and VERSION match):
        READY is loaded with an acquire load, so the caller's later reads of the fields
        see what the creator wrote. Never blocks."""
        if load_acquire(words, self.ready_at) != 1 or words[MAGIC_AT] != self.magic:
            return False
        return self.version_at is None or words[self.version_at] == self.version

    def describe(self, words) -> str:
        """What ``words`` hold instead of a ready segment of this layout, for an error."""
        version = "" if self.version_at is None else f", version {words[self.version_at]}"
        return f"magic {words[MAGIC_AT]:#x}{version}, ready {words[self.ready_at]}"
