"""Oversized batches are refused before they grow the engine: the size is known before
anything is copied, and pickling stops at the limit. Real engine processes; their peak
RSS (VmHWM) is read from inside."""

import subprocess
import sys
import textwrap

import pytest

# Puts one oversized batch into a TaskQueue and prints the ValueError and how much the
# peak RSS grew (MiB) across the put. The batch is built first: np.zeros leaves its pages
# untouched (they cost no RSS until written), and the bytes objects are counted before.
_PUT_TOO_BIG = textwrap.dedent("""
    import sys
    import numpy as np
    from fastdeploy_sync import TaskQueue
    name, endpoint, kind = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    if kind == "array":
        batch = [np.zeros(2 << 30, dtype=np.uint8)]                  # 2 GiB, out of band
    else:
        batch = [bytes([i]) * (1 << 20) for i in range(64)]          # 64 MiB, in the pickle
    def peak():  # MiB; VmHWM, not ru_maxrss, which keeps the forking process's peak
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) >> 10
    with TaskQueue(name, 1, endpoint=endpoint) as queue:
        before = peak()
        try:
            queue.put_tasks(batch, timeout=5)
        except ValueError as exc:
            print("refused", exc)
        else:
            print("accepted")
        print("grew", peak() - before)
        queue.close(timeout=0)
    """)


@pytest.mark.parametrize("path,kind,limit_mb", [
    ("tcp", "array", None), ("ipc socket", "array", None), ("tcp", "bytes", "16")],
    ids=["2GiB-array-tcp", "2GiB-array-ipc-socket", "64MiB-pickle-16MiB-limit"])
def test_an_oversized_batch_is_refused_before_it_grows_the_engine(name, path, kind, limit_mb,
                                                                  monkeypatch):
    """A 2 GiB array (out of band) over tcp, and over the ipc socket path (shared memory
    off), is refused with ValueError and the engine's peak RSS grows by less than 64 MiB;
    a 64 MiB pickle body under a 16 MiB limit stops pickling at the limit. Before: refused
    only after the copy (+2 GiB) or the whole pickle (+64 MiB)."""
    monkeypatch.setenv("FD_SYNC_INSECURE_TCP", "1")
    monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", "off")
    if limit_mb:
        monkeypatch.setenv("FD_SYNC_MAX_MESSAGE_MB", limit_mb)
    endpoint = "tcp://127.0.0.1:0" if path == "tcp" else ""
    out = subprocess.run([sys.executable, "-c", _PUT_TOO_BIG, name, endpoint, kind],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert "refused" in lines, out.stdout
    assert "limit" in lines["refused"] and "FD_SYNC_MAX_MESSAGE_MB" in lines["refused"]
    assert int(lines["grew"]) < (64 if kind == "array" else 24), out.stdout


# -- CURVE-encrypted tcp ---------------------------------------------------------------------

import numpy as np  # noqa: E402

from fastdeploy_sync import TaskQueue  # noqa: E402
from fastdeploy_sync.wire.auth import create_keys  # noqa: E402
from workers import collect, free_ports, take_n_rank  # noqa: E402


@pytest.fixture
def curve(tmp_path, monkeypatch):
    """Engine and workers share one key directory (FD_SYNC_KEYS_DIR, inherited)."""
    directory = create_keys(str(tmp_path / "keys"))["dir"]
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", directory)
    monkeypatch.delenv("FD_SYNC_INSECURE_TCP", raising=False)
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


def test_a_batch_too_large_to_encrypt_in_time_is_refused_at_put(name, curve):
    """libzmq encrypts a message in one piece, one copy per rank, in an I/O thread that
    answers no heartbeat meanwhile: a 600 MiB batch to TP=2 over CURVE made healthy ranks
    look gone and retired the group. Such a batch is refused at put_tasks() with a
    ValueError saying why and what to do (TP=2, heartbeat timeout 3 s: 192 MiB here),
    before anything is copied; the queue goes on."""
    with TaskQueue(name, 2, endpoint=curve) as queue:
        with pytest.raises(ValueError, match=r"CURVE-encrypted tcp endpoint, whose limit is "
                                             r"192 MiB: .*FD_SYNC_HEARTBEAT_TIMEOUT"):
            queue.put_tasks([np.zeros(300 << 20, dtype=np.uint8)], timeout=5)
        assert queue.num_tasks() == 0
        assert queue.put_tasks("small", timeout=5) == 1
        queue.close(timeout=0)


def test_a_large_batch_under_the_limit_crosses_curve_without_retiring_the_group(
        name, curve, procs, results):
    """64 MiB (a third of the limit) to a TP=2 group over CURVE: both ranks take it and the
    batch after it; the group is not retired."""
    with TaskQueue(name, 2, endpoint=curve) as queue:
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, 2, endpoint=curve)
        collect(results, "ready", 2)
        big = np.arange(8 << 20, dtype=np.int64)  # 64 MiB
        queue.put_tasks([big], timeout=30)
        queue.put_tasks("after", timeout=30)
        taken = collect(results, "taken", 2, timeout=120)
        for rank in range(2):
            assert int(taken[rank][0][0][-1]) == (8 << 20) - 1 and taken[rank][1] == "after"
        assert set(queue.stats()["retirements"]) <= {"left"}  # only the ranks closing after
