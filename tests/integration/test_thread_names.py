"""Every thread a worker starts has a name of its own: a stack dump (py-spy, faulthandler) or
a ``threading.enumerate()`` says which thread is which. The socket's receiver
(``fdsync-receiver-``), the ring's prefetch thread (``fdsync-ring-``) and sync mode's
heartbeat thread (``fdsync-heartbeat-``) were two of them named ``fdsync-prefetch-``."""

import threading

import pytest

from fastdeploy_sync import TaskClient, TaskQueue
from workers import make_batch, wait_until


def _threads_of(name):
    """The names of this process's live threads that belong to rank 0 of ``name``."""
    return sorted(t.name for t in threading.enumerate() if t.name.endswith(f"-{name}-r0"))


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_each_worker_thread_has_a_name_of_its_own(name, async_prefetch):
    with TaskQueue(name, 1) as queue, \
            TaskClient(name, 1, 0, async_prefetch=async_prefetch) as client:
        queue.put_tasks(make_batch(0), timeout=5)
        assert wait_until(lambda: client.exist_tasks(), timeout=10)
        assert [b for b, _ in client.get_tasks()[0]] == [0]
        assert client.stats()["ring"], "no ring attached: the ring's thread is not tested"
        expected = ([f"fdsync-receiver-{name}-r0", f"fdsync-ring-{name}-r0"] if async_prefetch
                    else [f"fdsync-heartbeat-{name}-r0"])
        assert wait_until(lambda: _threads_of(name) == expected, timeout=10), _threads_of(name)
    assert wait_until(lambda: _threads_of(name) == [], timeout=10), _threads_of(name)
