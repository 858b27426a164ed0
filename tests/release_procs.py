"""Processes for tests/integration/test_release_at_close.py: an engine whose Python threads
are starved while connections come and go, and processes that count what they hold."""

import os
import sys
import threading
import time
import traceback


def busy_engine(conn, busy, name, close_timeout):
    """An engine (tp_size 1) whose main thread holds the GIL, never giving it away, from
    when it says ``busy`` until ``busy.value`` is 0 (a shared byte, read without releasing
    the GIL): meanwhile its I/O thread cannot read the socket monitor, while libzmq's own
    I/O thread (no GIL) keeps accepting connections and reporting them to it. Then, told
    (any message), it closes the queue in a thread and sends ``("closed", seconds)``, or ``("hung", seconds)``
    after 20 s (and exits without waiting for that thread); ``("error", traceback)`` on
    a failure."""
    try:
        from fastdeploy_sync import TaskQueue

        queue = TaskQueue(name, 1)
        sys.setswitchinterval(1000.0)  # the main thread keeps the GIL while it runs
        conn.send(("busy", queue.endpoint))
        deadline = time.monotonic() + 120
        while busy.value and time.monotonic() < deadline:
            pass
        sys.setswitchinterval(0.005)
        conn.recv()  # "close"
        started = time.monotonic()
        closer = threading.Thread(target=queue.close, kwargs={"timeout": close_timeout},
                                  daemon=True)
        closer.start()
        closer.join(20)
        took = time.monotonic() - started
        conn.send(("hung" if closer.is_alive() else "closed", took))
        if closer.is_alive():
            os._exit(3)  # the queue is wedged: an orderly exit would wait on it
    except BaseException:
        conn.send(("error", traceback.format_exc()))
