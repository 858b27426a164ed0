"""Another program's live names on this node, for tests that look at /dev/shm (or the ipc
directory) as a whole: they must judge only the names they created.

    python tests/foreign_names.py

Creates, and holds open for its whole life, names that look like this library's (a TP
group segment and its barrier semaphore, a profile run's segment, an fd-manager flags
segment; each segment's owner lock held, as a live owner holds it) and names that do not
(a plain file, a semaphore), plus a socket file in the default ipc directory. Prints the
paths as one JSON line once they all exist, then waits until its stdin closes (or
SIGTERM) and removes them. Meanwhile it keeps making new live names of those kinds and
removing them again (``CHURN_S``), as another program's runs come and go: a test that
compares /dev/shm before and after meets names that were not there before.
``tests/conftest.py``'s ``foreign_names`` fixture and
``scripts/tools/busy_suite.py`` start it.
"""

import json
import os
import signal
import socket
import sys
import threading

import posix_ipc

from fastdeploy_sync import envs, names
from fastdeploy_sync.names import SHM_DIR
from fastdeploy_sync.shm.segment import Segment
from fastdeploy_sync.wire.endpoints import private_dir

CHURN_S = 0.05  # how long each coming-and-going name lives


def churn(tag, stop):
    """Until ``stop`` is set: a live fd-manager flags segment and a live profile run's
    segment, replaced by new ones every ``CHURN_S``."""
    held, k = [], 0
    try:
        while not stop.wait(CHURN_S):
            k += 1
            # a 7-digit number or more: never a port
            new = [Segment.create(f"/fdsync-fdq-exist-{tag[7:]}{k:06d}", 4096),
                   Segment.create(names.group_segment(f"prof{tag}c{k}", 0), 4096)]
            for seg in held:
                seg.close()
                os.unlink(names.shm_path(seg.name))
            held = new
    finally:
        for seg in held:
            seg.close()
            os.unlink(names.shm_path(seg.name))


def main() -> int:
    # SIGTERM ends it like a closed stdin: through the finally below, names removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pid = os.getpid()
    tag = f"foreign{pid}"
    held, paths = [], []
    try:
        # Looks like a live TP group of queue <tag>, a live profile run's segment and a live
        # fd-manager server's flags (a port number can never be that large).
        for name in (names.group_segment(tag, 0), names.group_segment(f"prof{tag}s0", 0),
                     f"/fdsync-fdq-exist-{1_000_000 + pid}"):
            held.append(Segment.create(name, 4096))
            paths.append(names.shm_path(name))
        for name in (names.group_semaphore(tag, 0, 0), f"/{tag}.lock"):
            held.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600))
            paths.append(names.semaphore_path(name))
        plain = f"{SHM_DIR}/{tag}"
        held.append(os.open(plain, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        paths.append(plain)
        sock_path = os.path.join(private_dir(envs.ipc_dir()), f"fdsync-{tag}-dp0.ipc")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(sock_path)
        sock.listen()
        held.append(sock)
        paths.append(sock_path)
        stop = threading.Event()
        churner = threading.Thread(target=churn, args=(tag, stop), daemon=True)
        churner.start()
        print(json.dumps(paths), flush=True)
        try:
            sys.stdin.read()  # until the starter closes our stdin (or exits)
        finally:
            stop.set()
            churner.join(timeout=10)
        return 0
    finally:
        for thing in reversed(held):
            if isinstance(thing, int):
                os.close(thing)
            elif isinstance(thing, posix_ipc.Semaphore):
                thing.unlink()
                thing.close()
            else:  # a Segment or the socket
                thing.close()
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    sys.exit(main())
