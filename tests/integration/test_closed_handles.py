"""Calls on a shared-memory handle after it let go of its memory or file: found by the type
checker (an attribute that is None once closed, used without a check), each now does what
its contract says instead of failing inside the standard library with a message that
names nothing."""

import pytest

from fastdeploy_sync.shm.payload import SharedPayload
from fastdeploy_sync.shm.segment import Segment, unlink_segment


def test_populate_after_close_does_nothing(name):
    """Segment.populate() is best effort and does nothing on a closed segment, as the
    module's populate() does on a closed mapping (before: AttributeError on None)."""
    seg = Segment.create(f"/{name}-seg", 4096)
    try:
        seg.populate(write=True)  # open: maps the page in
        seg.close()
        seg.populate(write=True)
        seg.populate(write=False)
    finally:
        seg.close()
        unlink_segment(f"/{name}-seg")


def test_write_after_seal_names_the_batch(name):
    """SharedPayload.write() after seal() raises ValueError naming the segment and what
    to do (before: os.pwrite's TypeError about a None file descriptor)."""
    payload = SharedPayload.create(f"/{name}-payload", 4096)
    try:
        payload.write(0, b"abc")
        payload.seal()
        with pytest.raises(ValueError, match=rf"shared batch /{name}-payload: write after "
                                             r"seal\(\).*before sealing"):
            payload.write(0, b"abc")
    finally:
        payload.release()  # seal() again, unlink
