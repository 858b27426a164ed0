"""shm.header.SegmentHeader: the one rule every segment layout is published and checked by."""

import numpy as np

from fastdeploy_sync.shm.header import MAGIC_AT, SegmentHeader


def _words(n=8):
    return memoryview(np.zeros(n, dtype=np.int64)).cast("B").cast("q")


def test_ready_only_once_published_with_this_magic_and_version():
    header = SegmentHeader(0x1234, ready_at=5, version=3, version_at=2)
    words = _words()
    assert not header.ready(words)  # all zeros: nothing published
    header.publish(words, {3: 77, 4: 88})
    assert list(words) == [0x1234, 0, 3, 77, 88, 1, 0, 0]
    assert header.ready(words)
    assert not SegmentHeader(0x1234, ready_at=5, version=4, version_at=2).ready(words)
    assert not SegmentHeader(0x9999, ready_at=5, version=3, version_at=2).ready(words)
    words[2] = 9
    assert not header.ready(words)
    assert header.describe(words) == "magic 0x1234, version 9, ready 1"


def test_a_layout_without_a_version_word_checks_magic_and_ready():
    header = SegmentHeader(0x55, ready_at=3)
    words = _words(4)
    words[MAGIC_AT] = 0x55  # MAGIC without READY: a creator still writing
    assert not header.ready(words)
    header.publish(words, {2: 7})
    assert header.ready(words) and words[2] == 7
    assert header.ready(tuple(words))  # words read with pread check the same way
    assert header.describe(words) == "magic 0x55, ready 1"
