"""Sealed shared memory (shm.sealed): what a process maps through an anchor can never shrink,
a process maps only memory it checked is the recorded sealed memfd, one in another pid
namespace receives the memfd over its creator's socket (shm.memfd_server), which answers
only its own uid and survives any peer, and one that can reach the memfd neither way gets
an error that names both attempts."""

import fcntl
import gc
import glob
import json
import os
import queue as queue_module
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from conftest import ROOT, TESTS, needs_pid_namespace
from fastdeploy_sync import TaskQueue, cleanup, names
from fastdeploy_sync.shm import memfd_server
from fastdeploy_sync.shm.sealed import SealedSegment, SealedUnreachable
from fastdeploy_sync.shm.segment import Segment, unlink_segment
from fastdeploy_sync.testing.processes import reap
from fastdeploy_sync.wire.endpoints import close_listeners
from workers import wait_until


@pytest.fixture
def shm_name():
    name = f"/fdsync.t{uuid.uuid4().hex[:12]}.sealed"
    yield name
    unlink_segment(name)
    assert not os.path.exists(names.shm_path(name))


@pytest.fixture
def own_ipc_dir(monkeypatch):
    """An ipc directory of this test's own (FD_SYNC_IPC_DIR), and no sealed-memory server
    running in this process yet (one left by an earlier test would serve from another)."""
    memfd_server.withdraw("", 0)  # stops a server serving nothing (a collected segment's)
    assert memfd_server.served() is None, memfd_server.served()
    path = tempfile.mkdtemp(prefix="fdsm-", dir="/tmp")  # short: a unix socket path
    monkeypatch.setenv("FD_SYNC_IPC_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fds():
    return set(os.listdir("/proc/self/fd"))


def _token(shm_name):
    anchor = Segment.attach(shm_name)
    try:
        return anchor.read_words(7, 1)[0]  # the anchor's server token
    finally:
        anchor.close()


def _wait_child(pid, timeout=30):
    """The exit code of forked child ``pid``; killed (and a failure) after ``timeout``."""
    status = reap(pid, timeout)
    if status is None:
        pytest.fail(f"forked child {pid} did not finish within {timeout} s")
    return os.waitstatus_to_exitcode(status)


def _lines(proc):
    """A queue fed with ``proc``'s stdout lines by a daemon thread (None at EOF), so that
    every read can have a timeout."""
    lines = queue_module.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next_line(lines, timeout=60):
    try:
        return lines.get(timeout=timeout)
    except queue_module.Empty:
        return None


def _memfds(fds):
    found = []
    for f in fds:
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:"):
                found.append(f)
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return found


def test_what_a_process_maps_cannot_be_truncated(shm_name):
    """Neither the creator's memfd, nor a descriptor opened through /proc, nor the
    anchor's name can shrink what an attached process maps; close() releases every
    descriptor without the garbage collector."""
    gc.disable()
    try:
        before = _fds()
        made = SealedSegment.create(shm_name, 1 << 16)
        made.view[100] = 42
        seen = SealedSegment.attach(shm_name)
        assert seen.size == 1 << 16 and seen.view[100] == 42
        memfds = _memfds(_fds() - before)  # the creator's, and each mapping's own
        assert memfds
        for memfd in memfds:
            with pytest.raises(PermissionError):
                os.ftruncate(int(memfd), 0)
            with pytest.raises(PermissionError):
                os.truncate(f"/proc/self/fd/{memfd}", 4096)
        os.truncate(names.shm_path(shm_name), 0)  # the anchor only
        seen.view[(1 << 13) - 1] = 7  # the last word: still mapped, still there
        assert made.view[(1 << 13) - 1] == 7
        served = memfd_server.served()
        assert list(served["memfds"]) == [shm_name]
        seen.close()
        made.unlink_if_mine()
        made.close()
        assert _fds() == before  # the server's socket, pipe and duplicates too
        assert memfd_server.served() is None and not os.path.exists(served["path"])
        assert not [t for t in threading.enumerate() if t.name == "fdsync-memfd-server"]
    finally:
        gc.enable()


def test_an_anchor_naming_unsealed_memory_is_refused(shm_name):
    """An anchor that names a memfd which is not sealed (as a process of this user could
    forge it: the right inode, size and uid) is refused before anything is mapped."""
    made = SealedSegment.create(shm_name, 1 << 16)
    loose = os.memfd_create("loose", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(loose, 1 << 16)
        st = os.fstat(loose)
        anchor = Segment.attach(shm_name)
        try:
            anchor.write_words(2, (loose, st.st_ino, st.st_dev, 1 << 16))
        finally:
            anchor.close()
        with pytest.raises(SealedUnreachable, match="not the sealed memory"):
            SealedSegment.attach(shm_name)
        assert fcntl.fcntl(loose, fcntl.F_GET_SEALS) == 0
    finally:
        os.close(loose)
        made.unlink_if_mine()
        made.close()


_CREATOR = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from fastdeploy_sync.shm import memfd_server
    from fastdeploy_sync.shm.sealed import SealedSegment
    seg = SealedSegment.create({name!r}, 1 << 16)
    seg.view[100] = 42
    print("READY", os.getpid(), memfd_server.served()["path"], flush=True)
    sys.stdin.readline()
    seg.unlink_if_mine()
    seg.close()
    print("CLOSED", memfd_server.served(), flush=True)
""")


def _creator_elsewhere(shm_name, env=None):
    """A creator of ``shm_name`` in a pid namespace of its own, and its stdout lines."""
    code = _CREATOR.format(root=ROOT, name=shm_name)
    proc = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", "--kill-child",
                             sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    return proc, _lines(proc)


def _finish(proc, lines):
    """Let the creator close; its last line."""
    proc.stdin.write("done\n")
    proc.stdin.close()
    last = _next_line(lines)
    assert proc.wait(timeout=30) == 0
    return last


@needs_pid_namespace
def test_a_creator_in_another_pid_namespace_is_reached_through_its_socket(shm_name):
    """The creator runs in a pid namespace of its own (a container sharing /dev/shm and
    the ipc directory): /proc/<its pid> is not it here, so the attacher receives the memfd
    over the creator's socket, checks it and maps it. Before: SealedUnreachable."""
    proc, lines = _creator_elsewhere(shm_name)
    try:
        ready = (_next_line(lines) or "").split()
        assert ready[:2] == ["READY", "1"], ready  # pid 1: a pid namespace of its own
        path = ready[2]
        assert os.stat(path).st_mode & 0o777 == 0o600
        seen = SealedSegment.attach(shm_name)
        try:
            assert seen.size == 1 << 16 and seen.view[100] == 42
            seen.view[101] = 7  # the same memory, both ways
        finally:
            seen.close()
        assert _finish(proc, lines).strip() == "CLOSED None"
        assert not os.path.exists(path)  # its last memfd closed: the server left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@needs_pid_namespace
def test_a_creator_reachable_neither_way_is_an_error_naming_both(shm_name, own_ipc_dir):
    """The creator in another pid namespace serves from another ipc directory than ours:
    neither /proc nor the socket reaches it, and the error names both and what to do."""
    env = dict(os.environ, FD_SYNC_IPC_DIR=tempfile.mkdtemp(prefix="fdsm-", dir="/tmp"))
    proc, lines = _creator_elsewhere(shm_name, env)
    try:
        assert (_next_line(lines) or "").startswith("READY 1 ")
        with pytest.raises(SealedUnreachable) as raised:
            SealedSegment.attach(shm_name)
        message = str(raised.value)
        assert "/proc/1/fd/" in message and os.path.join(own_ipc_dir, "fdsync-memfd.") in \
            message and "pid namespace" in message and "FD_SYNC_IPC_DIR" in message, message
        _finish(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(env["FD_SYNC_IPC_DIR"], ignore_errors=True)


def test_a_peer_of_another_uid_gets_nothing(shm_name, own_ipc_dir):
    """A process of another uid that reaches the socket (its directory and file opened up
    here on purpose) is closed on before anything is sent; the server goes on serving."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the peer of another uid is a forked child that setuid()s")
    made = SealedSegment.create(shm_name, 1 << 16)
    try:
        path = memfd_server.served()["path"]
        os.chmod(own_ipc_dir, 0o711)
        os.chmod(path, 0o666)
        pid = os.fork()
        if pid == 0:  # the stranger
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                peer.settimeout(10)
                peer.connect(path)
                try:
                    peer.sendall(memfd_server.request(shm_name))
                    msg, fds, _, _ = socket.recv_fds(peer, 16, 1)
                except (BrokenPipeError, ConnectionResetError):  # closed on, unread
                    msg, fds = b"", []
                code = 0 if msg == b"" and not fds else 2
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0  # connected, asked, and got nothing
        fd = memfd_server.fetch(shm_name, _token(shm_name))  # ours still served
        try:
            assert os.fstat(fd).st_ino == memfd_server.served()["memfds"][shm_name]
        finally:
            os.close(fd)
    finally:
        made.unlink_if_mine()
        made.close()


def test_silent_garbage_and_vanishing_peers_do_not_stop_the_server(shm_name, own_ipc_dir):
    """Peers that connect and say nothing, send garbage, send half a request or leave at
    once: the next request is still answered (within fetch's bound), and a request for a
    name the process does not serve is refused."""
    made = SealedSegment.create(shm_name, 1 << 16)
    peers = []
    try:
        path, token = memfd_server.served()["path"], _token(shm_name)
        for what in (b"", b"x" * (memfd_server.REQUEST_BYTES + 100), b"FDSYMFD1/fd", None):
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.settimeout(5)
            peer.connect(path)
            peers.append(peer)
            if what:
                peer.sendall(what)
            if what is None or what.startswith(b"FDSYMFD1"):
                peer.close()  # leaves (midway)
        fd = memfd_server.fetch(shm_name, token)  # the silent peer still connected
        try:
            assert os.fstat(fd).st_ino == memfd_server.served()["memfds"][shm_name]
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="refused"):
            memfd_server.fetch(shm_name + "x", token)
    finally:
        for peer in peers:
            peer.close()
        made.unlink_if_mine()
        made.close()


def test_a_forked_child_never_serves_nor_removes_the_parents_socket(shm_name, own_ipc_dir):
    """A child forked from a creator holds no listening socket of its parent's server,
    has no server, and closing its inherited copy removes nothing: the parent serves on."""
    made = SealedSegment.create(shm_name, 1 << 16)
    try:
        path = memfd_server.served()["path"]
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                listening = close_listeners([path])  # the inherited listener: closed at fork
                alone = memfd_server.served() is None
                made.close()
                code = 0 if (listening, alone, os.path.exists(path)) == (0, True, True) else 2
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0
        assert os.path.exists(path)
        fd = memfd_server.fetch(shm_name, _token(shm_name))
        os.close(fd)
    finally:
        made.unlink_if_mine()
        made.close()
    assert not os.path.exists(path)


def test_a_starting_server_removes_killed_servers_sockets_only(shm_name, own_ipc_dir):
    """Socket files of servers of killed processes (random names: nobody else would ever
    reclaim them) are removed when a server starts, once older than STALE_AFTER_S; a
    younger one (a server between bind and listen) and a live one are kept."""
    old = time.time() - memfd_server.STALE_AFTER_S - 10
    paths = {what: os.path.join(own_ipc_dir, names.memfd_socket(token))
             for what, token in (("stale", 1), ("young", 2), ("live", 3))}
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for what, path in paths.items():
            sock = live if what == "live" else socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            if what == "live":
                sock.listen(1)
            else:
                sock.close()  # nobody listens: what a killed process leaves
            if what != "young":
                os.utime(path, (old, old))
        made = SealedSegment.create(shm_name, 1 << 16)
        try:
            left = {what for what, path in paths.items() if os.path.exists(path)}
            assert left == {"young", "live"}, left
        finally:
            made.unlink_if_mine()
            made.close()
    finally:
        live.close()


def test_a_process_leaving_without_close_removes_its_servers_socket(shm_name):
    """A creator that exits normally without closing its sealed memory (its objects
    garbage at exit, or never collected) leaves no socket file: the server's finalizer
    removes it at exit."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from fastdeploy_sync.shm import memfd_server
        from fastdeploy_sync.shm.sealed import SealedSegment
        kept = SealedSegment.create({shm_name!r}, 1 << 16)
        print(memfd_server.served()["path"], flush=True)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert os.path.basename(path).startswith("fdsync-memfd.") and not os.path.exists(path)


def test_clean_removes_a_stale_servers_socket_and_keeps_a_live_one(shm_name, own_ipc_dir):
    """A sealed-memory server's socket left by a killed process is stale for
    `fastdeploy-sync clean`; a live server's is in use."""
    stale = os.path.join(own_ipc_dir, names.memfd_socket(0x0123456789abcdef))
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(stale)
    left.close()  # nobody listens: what a killed process leaves
    made = SealedSegment.create(shm_name, 1 << 16)
    try:
        live = memfd_server.served()["path"]
        found = {item.path: item for item in cleanup.scan() if item.kind == "memfd"}
        assert found[stale].stale and not found[live].stale, found
        assert cleanup.describe(found[stale]).startswith(f"{stale}  (sealed-memory server")
        assert [item.path for item in cleanup.remove(found.values())] == [stale]
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        made.unlink_if_mine()
        made.close()


# -- a TP group whose ranks run in other pid namespaces ---------------------------------------

_COUNT = 6  # small batches (the ring), then one large one (the pool)
_LARGE = 300_000  # int64s: 2.4 MB, more than a ring slot (1 MiB): the pool

_RANK = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from fastdeploy_sync import TaskClient
    from workers import wait_until

    def take(client, want, taken, kept):
        deadline = time.monotonic() + 60
        while len(taken) < want and time.monotonic() < deadline:
            if not wait_until(client.exist_tasks, timeout=1):
                continue
            client.barrier(timeout=30)
            for batch in client.get_tasks()[0]:
                kept.append(batch["ids"])  # arrays kept, as a model may keep them
                taken.append([batch["i"], int(batch["ids"].sum()), len(batch["ids"])])

    with TaskClient({name!r}, 2, {rank}, async_prefetch=False) as client:
        taken, kept = [], []
        take(client, {count} + 1, taken, kept)
        stats = client.stats()
        print(json.dumps(dict(pid=os.getpid(), taken=taken, ring=stats["ring"],
                              no_ring=stats.get("no_ring", 0))), flush=True)
        sys.stdin.readline()  # meanwhile the anchors in /dev/shm are truncated
        sums = [int(a.sum()) for a in kept]
        take(client, {count} + 2, taken, kept)
        print(json.dumps(dict(sums=sums, taken=taken)), flush=True)
""")


def _next(lines, proc, err, timeout=90):
    """The next JSON line of rank ``proc``, or a failure showing its stderr ``err``."""
    line = _next_line(lines, timeout)
    if line is None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"rank exited ({proc.returncode}): {err.read_text()[-3000:]}")
    return json.loads(line)


@needs_pid_namespace
def test_ranks_in_another_pid_namespace_take_every_batch_through_the_ring(name, monkeypatch,
                                                                          tmp_path):
    """Engine here, each rank of a TP=2 group in a pid namespace of its own: every batch
    goes through the ring (one through the pool), both ranks take identical batches, keep
    their arrays across a truncation of every anchor in /dev/shm, and take the next batch
    through the ring. Before: each rank raised SealedUnreachable at the engine's WELCOME."""
    monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "8")  # a small pool: quick to reserve
    ranks = []
    with TaskQueue(name, 2) as queue:
        try:
            for rank in range(2):
                code = _RANK.format(tests=TESTS, name=name, rank=rank, count=_COUNT)
                err = tmp_path / f"rank{rank}.err"
                with open(err, "w") as sink:
                    proc = subprocess.Popen(
                        ["unshare", "-p", "-f", "--mount-proc", "--kill-child", sys.executable,
                         "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=sink, text=True)
                ranks.append((proc, _lines(proc), err))
            assert wait_until(lambda: all(r["state"] == "connected" for r in queue.ranks())
                              or any(proc.poll() is not None for proc, _, _ in ranks), 60)
            for proc, _, err in ranks:
                assert proc.poll() is None, f"rank exited: {err.read_text()[-3000:]}"
            for i in range(_COUNT):
                queue.put_tasks({"i": i, "ids": np.full(1000, i, dtype=np.int64)}, timeout=30)
            queue.put_tasks({"i": _COUNT, "ids": np.arange(_LARGE, dtype=np.int64)}, timeout=30)
            first = [_next(lines, proc, err) for proc, lines, err in ranks]
            expected = [[i, 1000 * i, 1000] for i in range(_COUNT)]
            expected.append([_COUNT, sum(range(_LARGE)), _LARGE])
            for report in first:
                assert report["pid"] == 1, report  # it did run in a pid namespace of its own
                assert report["taken"] == expected, report
                assert report["ring"] is not None and report["no_ring"] == 0, report
            served = memfd_server.served()
            assert served is not None and len(served["memfds"]) == 2, served  # ring, pool
            anchors = glob.glob(names.shm_path(names.payload_prefix(name, 0)) + "*")
            assert len(anchors) == 2, anchors
            for path in anchors:
                os.truncate(path, 0)  # only the anchors: the memory is the memfds'
            for proc, _, _ in ranks:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            queue.put_tasks({"i": _COUNT + 1, "ids": np.full(1000, 5, dtype=np.int64)},
                            timeout=30)
            second = [_next(lines, proc, err) for proc, lines, err in ranks]
            for report in second:
                assert report["sums"] == [row[1] for row in expected], report
                assert report["taken"][-1] == [_COUNT + 1, 5000, 1000], report
            stats = queue.stats()
            assert stats["shm_ring_batches"] == _COUNT + 1, stats
            assert stats["shm_pool_batches"] == 1 and stats.get("sent", 0) == 0, stats
            for proc, _, err in ranks:
                assert proc.wait(timeout=60) == 0, err.read_text()[-3000:]
        finally:
            for proc, _, _ in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
                proc.stdin.close()
    # the engine closed its ring and pool: its server stopped and its socket file is gone
    assert memfd_server.served() is None
    assert not os.path.exists(served["path"])
