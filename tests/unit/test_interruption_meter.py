"""ThreadInterruption's bounded memory (no thread measured)."""

import os

import pytest

from fastdeploy_sync.profiling.interruption import ThreadInterruption

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
                                reason="needs Linux /proc/<pid>/task/<tid>/schedstat")


def test_capacity_bounds_what_is_kept_and_start_resets():
    meter = ThreadInterruption(3)
    for _ in range(5):
        meter.begin()
        meter.end()
    a = meter.arrays()
    assert len(a["wall_ns"]) == 3 and (a["wall_ns"] >= 0).all()
    meter.start(2)
    assert len(meter.arrays()["wall_ns"]) == 0
    meter.close()
    meter.close()  # idempotent
