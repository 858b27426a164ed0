"""Node-local ipc sockets live in a private per-user directory; another user's directory or
socket file is refused, never used or unlinked. CI runs as root, so "another user" is made
with os.chown(path, 12345, 12345)."""

import errno  # noqa: E402
import os
import socket
import stat
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile
import textwrap  # noqa: E402

import posix_ipc
import pytest

from fastdeploy_sync import envs
from fastdeploy_sync.engine.queue import TaskQueue
from fastdeploy_sync.errors import EndpointInUseError
from fastdeploy_sync.shm.segment import Segment, reclaim_stale, segment_owner, unlink_segment
from fastdeploy_sync.shm.semaphores import (
    check_semaphore_owner,
    create_semaphore,
    open_semaphore,
    unlink_semaphore,
)
from fastdeploy_sync.wire.endpoints import (
    check_ipc_endpoint,
    claim_ipc_path,
    ipc_path,
    private_dir,
    secure_socket_file,
)
from fastdeploy_sync.wire.sockets import CLIENT_FDS

OTHER = 12345


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _bound_socket(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    return s


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_root
def test_socket_file_of_another_user_is_refused_and_kept(ipc_env):
    d = private_dir(str(ipc_env / "ours"))
    path = os.path.join(d, "fdsync-llm-dp0.ipc")
    s = _bound_socket(path)
    s.close()  # not even listening: a stale file, but not ours to remove
    os.chown(path, OTHER, OTHER)
    with pytest.raises(PermissionError, match=f"{path} is owned by uid {OTHER}"):
        claim_ipc_path(path)
    assert os.path.exists(path)
    with pytest.raises(PermissionError, match=f"owned by uid {OTHER}.*Do not connect"):
        check_ipc_endpoint(path)
    with pytest.raises(PermissionError):
        secure_socket_file(path)


def test_stale_socket_of_ours_is_reclaimed_and_live_one_is_not(ipc_env):
    d = private_dir(str(ipc_env / "ours"))
    path = os.path.join(d, "fdsync-llm-dp0.ipc")
    _bound_socket(path).close()  # a crashed engine's leftover
    check_ipc_endpoint(path)
    claim_ipc_path(path)
    assert not os.path.exists(path)
    live = _bound_socket(path)
    live.listen(1)
    try:
        with pytest.raises(EndpointInUseError):
            claim_ipc_path(path)
        assert os.path.exists(path)
    finally:
        live.close()
        os.unlink(path)


def test_a_live_socket_with_a_full_backlog_is_in_use_not_an_error(ipc_env):
    """A busy engine whose listen backlog is full answers EAGAIN: it is alive (was a bare
    BlockingIOError out of TaskQueue's constructor)."""
    d = private_dir(str(ipc_env / "ours"))
    path = os.path.join(d, "fdsync-llm-dp0.ipc")
    live = _bound_socket(path)
    live.listen(0)
    waiting = []
    try:
        while True:  # fill the backlog: nobody accepts
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            waiting.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break
            assert len(waiting) < 100, "the backlog never filled"
        with pytest.raises(EndpointInUseError):
            claim_ipc_path(path)
        assert os.path.exists(path)
    finally:
        for c in waiting:
            c.close()
        live.close()
        os.unlink(path)


def test_secure_socket_file_makes_it_0600(ipc_env):
    d = private_dir(str(ipc_env / "ours"))
    path = os.path.join(d, "s.ipc")
    old = os.umask(0o000)
    try:
        s = _bound_socket(path)
    finally:
        os.umask(old)
    try:
        assert _mode(path) & 0o077  # the umask let group/other in
        secure_socket_file(path)
        assert _mode(path) == 0o600
    finally:
        s.close()
        os.unlink(path)


def test_engine_in_default_location_works_and_leaves_nothing(ipc_env, monkeypatch, name):
    short = tempfile.mkdtemp(prefix="fdt")  # pytest's tmp_path can exceed the 107-byte limit
    monkeypatch.setattr(tempfile, "tempdir", short)
    try:
        q = TaskQueue(name, 1)
        try:
            path = ipc_path(q.endpoint)
            assert os.path.dirname(path) == envs.ipc_dir() == f"{short}/fastdeploy_sync-{os.geteuid()}"
            assert _mode(os.path.dirname(path)) == 0o700
            check_ipc_endpoint(path)
        finally:
            q.close()
        assert not os.path.exists(path)
    finally:
        os.rmdir(envs.ipc_dir())
        os.rmdir(short)


def test_segment_and_semaphore_are_created_0600(name):
    old = os.umask(0o000)
    try:
        seg = Segment.create(f"/{name}", 64)
        sem = create_semaphore(f"/{name}.w0")
    finally:
        os.umask(old)
    try:
        assert _mode(f"/dev/shm/{name}") == 0o600
        assert _mode(f"/dev/shm/sem.{name}.w0") == 0o600
        assert check_semaphore_owner(f"/{name}.w0")
        open_semaphore(f"/{name}.w0").close()
        other = Segment.attach(f"/{name}")
        assert other.size == 64
        other.close()
    finally:
        seg.close()
        sem.close()
        unlink_segment(f"/{name}")
        unlink_semaphore(f"/{name}.w0")


@needs_root
def test_segment_of_another_user_is_never_mapped_or_unlinked(name):
    seg = Segment.create(f"/{name}", 64)
    seg.view[1] = 999_999_999  # a "dead" owner pid: would be reclaimed if it were ours
    seg.close()
    os.chown(f"/dev/shm/{name}", OTHER, OTHER)
    try:
        with pytest.raises(PermissionError, match=f"shared memory /{name} is owned by uid {OTHER}"):
            Segment.attach(f"/{name}")
        with pytest.raises(PermissionError, match=f"uid {OTHER}"):
            segment_owner(f"/{name}")
        with pytest.raises(PermissionError, match=f"uid {OTHER}"):
            reclaim_stale(f"/{name}")
        assert os.path.exists(f"/dev/shm/{name}")
        with pytest.raises(FileExistsError):
            Segment.create(f"/{name}", 64)
    finally:
        unlink_segment(f"/{name}")


@needs_root
def test_semaphore_of_another_user_is_refused(name):
    create_semaphore(f"/{name}.w0").close()
    os.chown(f"/dev/shm/sem.{name}.w0", OTHER, OTHER)
    try:
        with pytest.raises(PermissionError, match=rf"semaphore /{name}.w0 is owned by uid {OTHER}"):
            open_semaphore(f"/{name}.w0")
        with pytest.raises(FileExistsError):
            create_semaphore(f"/{name}.w0")
        assert unlink_semaphore(f"/{name}.w0") is False  # another user's: never removed
    finally:
        posix_ipc.unlink_semaphore(f"/{name}.w0")  # the test's own cleanup, as root
    with pytest.raises(FileNotFoundError):
        open_semaphore(f"/{name}.w0")


def test_fd_exhaustion_raises_emfile_and_the_process_lives_on():
    child = textwrap.dedent("""
        import errno, os, resource
        from fastdeploy_sync.wire.sockets import CLIENT_FDS, ensure_free_fds
        import zmq  # loaded before the limit, as in a real worker
        open_now = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = open_now + 10  # fewer free fds than a TaskClient needs
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        try:
            ensure_free_fds(CLIENT_FDS, "TaskClient rank 1 of 'llm' dp_id=0")
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            print("RAISED", exc)
        else:
            raise SystemExit("no error with %d fds allowed" % low)
        # still alive and usable: fds were released, we can compute and open files
        with open(os.devnull) as f:
            f.read()
        print("SUM", sum(range(1000)))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        ensure_free_fds(CLIENT_FDS, "after raising the limit")
        ctx = zmq.Context(io_threads=1)
        ctx.socket(zmq.DEALER).close(0)
        ctx.term()
        print("ZMQ OK")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert f"RAISED [Errno {errno.EMFILE}] TaskClient rank 1 of 'llm' dp_id=0 needs about " \
           f"{CLIENT_FDS} free file descriptors" in done.stdout
    assert "raise ulimit -n" in done.stdout and "(ulimit -n is " in done.stdout
    assert "SUM 499500" in done.stdout and "ZMQ OK" in done.stdout
