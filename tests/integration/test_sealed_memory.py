"""Sealed shared memory (shm.sealed): what a process maps through an anchor can never shrink,
a process maps only memory it checked is the recorded sealed memfd, and one that cannot
reach the creator's memfd (another pid namespace) gets an error that says so."""

import fcntl
import gc
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from fastdeploy_sync.shm.sealed import SealedSegment, SealedUnreachable
from fastdeploy_sync.shm.segment import Segment, unlink_segment

from conftest import ROOT, needs_pid_namespace


@pytest.fixture
def shm_name():
    name = f"/fdsync.t{uuid.uuid4().hex[:12]}.sealed"
    yield name
    unlink_segment(name)
    assert not os.path.exists("/dev/shm" + name)


def _fds():
    return set(os.listdir("/proc/self/fd"))


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
        os.truncate("/dev/shm" + shm_name, 0)  # the anchor only
        seen.view[(1 << 13) - 1] = 7  # the last word: still mapped, still there
        assert made.view[(1 << 13) - 1] == 7
        seen.close()
        made.unlink_if_mine()
        made.close()
        assert _fds() == before
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
    import sys
    sys.path.insert(0, {root!r})
    from fastdeploy_sync.shm.sealed import SealedSegment
    seg = SealedSegment.create({name!r}, 1 << 16)
    print("READY", flush=True)
    sys.stdin.readline()
    seg.unlink_if_mine()
    seg.close()
""")


@needs_pid_namespace
def test_a_creator_in_another_pid_namespace_is_an_error_that_says_so(shm_name):
    """The creator runs in a pid namespace of its own (a container sharing /dev/shm): its
    anchor is found, its memory cannot be reached, and attach says why and what to do."""
    code = _CREATOR.format(root=ROOT, name=shm_name)
    proc = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        with pytest.raises(SealedUnreachable, match="pid namespace|not the sealed memory"):
            SealedSegment.attach(shm_name)
        proc.communicate("done\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0
