"""fastdeploy-sync status: read a live group's watermarks without joining it."""

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import SPAWN
from fastdeploy_sync import TaskQueue
from workers import collect, hold_group_rank, take_n_rank, wait_until


def _status(name, *extra):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", name, *extra],
                          capture_output=True, text=True, timeout=30)


def _rows(stdout):
    """The shared-memory table's rows (rank, pid, alive, received, consumed, ...)."""
    return [line.split() for line in stdout.splitlines()
            if line.strip()[:1].isdigit() and line.split()[1].isdigit()]


def _engine_rows(stdout):
    """The engine table's rows (rank, state, consumed, silent, worker, reason)."""
    return [line.split() for line in stdout.splitlines()
            if line.strip()[:1].isdigit() and not line.split()[1].isdigit()]


def test_status_of_a_live_group(name, procs, results):
    """Two ranks that can take 3 batches from the ring and take none: status shows the
    ring holding 3 and the ranks having consumed none."""
    with TaskQueue(name, 2) as queue:
        # the ranks stay until the status was read: with 3 s, they had left (and their
        # group segment was gone) before a loaded machine's status commands had run
        leave = SPAWN.Event()
        for rank in range(2):
            procs(hold_group_rank, results, rank, name, 2, 120.0, leave)
        pids = collect(results, "ready", 2)
        for i in range(3):
            queue.put_tasks(i, timeout=5)
        assert wait_until(lambda: "ring, published up to seq 3" in _status(name).stdout, 60)
        out = _status(name)
        leave.set()
    assert out.returncode == 0, out.stderr
    assert "tp_size=2" in out.stdout and f"owner pid {pids[0]} (alive)" in out.stdout
    rows = _rows(out.stdout)
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        ("0", str(pids[0]), "True", "0"), ("1", str(pids[1]), "True", "0")]
    assert f"engine {name!r} dp_id=0 tp_size=2" in out.stdout and "last seq 3" in out.stdout
    assert [(r[0], r[1]) for r in _engine_rows(out.stdout)] == [("0", "connected"),
                                                                ("1", "connected")]


def test_status_asks_the_engine_whatever_the_coordinator(name, procs, results, monkeypatch):
    """A TP=1 group on a tcp endpoint has no node-local shared memory: the engine's view is
    still there (the same path serves paddle-coordinated groups)."""
    monkeypatch.setenv("FD_SYNC_INSECURE_TCP", "1")
    with TaskQueue(name, 1, endpoint="tcp://127.0.0.1:0") as queue:
        procs(take_n_rank, results, 0, name, 1, 2, endpoint=queue.endpoint)
        for i in range(2):
            queue.put_tasks(i, timeout=5)
        collect(results, "taken", 1)
        assert wait_until(lambda: queue.stats()["consumed"] == [2])
        out = _status(name, "--endpoint", queue.endpoint)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no node-local group segment" in out.stdout
    # the rank's process exits once it took its batches: the engine may already know
    rows = _engine_rows(out.stdout)
    assert [(r[0], r[2]) for r in rows] == [("0", "2")]
    assert rows[0][1] in ("connected", "disconnected"), rows


def test_status_of_no_group(name):
    out = _status(name, "--timeout", "0.5")
    assert out.returncode == 1
    assert "no TaskQueue answered" in out.stdout and "no node-local group segment" in out.stdout


def _cli(*argv, timeout=30):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", *argv],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv, says", [
    (["status", "bad/name"], "NAME 'bad/name'"),
    (["status", "x", "--dp-id", "5000"], "--dp-id: 5000"),
    (["status", "x", "--timeout", "-1"], "--timeout"),
    (["clean", ".hidden"], "NAME '.hidden'"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_usage_errors_are_one_line_with_exit_status_2(argv, says):
    out = _cli(*argv)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and says in lines[0] and "--help" in lines[0]


def test_runtime_error_is_one_line_without_traceback(tmp_path):
    """A private ipc directory that is not private: the command says what to do, exit 1."""
    loose = tmp_path / "ipc"
    loose.mkdir()
    os.chmod(loose, 0o777)
    out = subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", "x"],
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, FD_SYNC_IPC_DIR=str(loose)))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "chmod 700" in out.stderr


def test_status_says_plainly_that_no_engine_answered(name):
    out = _status(name, "--timeout", "0.3")
    assert out.returncode == 1
    assert out.stdout.startswith("no engine answered: ")
    assert "whole story" not in out.stdout
    assert f"nothing of {name!r} dp 0 runs on this node" in out.stdout


def test_status_watch_refreshes_until_interrupted(name, procs, results, tmp_path):
    import signal

    with TaskQueue(name, 2):
        for rank in range(2):
            procs(hold_group_rank, results, rank, name, 2, 5.0)
        collect(results, "ready", 2)
        # SIGINT as in a terminal (a shell running the suite in the background would hand
        # the child SIGINT ignored)
        # its stderr to a file: a pipe nobody reads until the end could fill and block it
        with (tmp_path / "stderr").open("w") as err:
            watch = subprocess.Popen(
                [sys.executable, "-m", "fastdeploy_sync.cli", "status", name, "--watch", "0.2"],
                stdout=subprocess.PIPE, stderr=err, text=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # Ctrl-C once it has shown three whole snapshots (each ends with an empty line),
        # between two asks: a fixed sleep interrupted its imports on a loaded machine
        # (KeyboardInterrupt, exit status 1)
        header = f"fastdeploy-sync status {name} --dp-id 0"
        lines = []

        def read():
            for line in watch.stdout:
                lines.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            wait_until(lambda: lines.count("\n") >= 3, 120)
        finally:
            watch.send_signal(signal.SIGINT)
            try:
                watch.wait(timeout=30)
            finally:
                if watch.poll() is None:
                    watch.kill()
                    watch.wait(timeout=10)
                reader.join(timeout=10)
                watch.stdout.close()
    stderr = (tmp_path / "stderr").read_text()
    stdout = "".join(lines)
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr
    snapshots = stdout.count(header)
    assert snapshots >= 3, stdout
    # every snapshot but perhaps the one Ctrl-C cut short shows the engine's view
    assert stdout.count(f"engine {name!r} dp_id=0 tp_size=2") >= snapshots - 1


# Runs `fastdeploy-sync status NAME --watch 0.001` (the CLI's main) again each time Ctrl-C
# ended it, and says on the pipe fd argv[2] when each snapshot starts and how each run
# ended. The snapshots themselves go nowhere: only their headers are counted.
_WATCH_AGAIN = r"""
import os, signal, sys
from fastdeploy_sync.cli import main

name, marks = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell hands SIG_IGN


class Snapshots:
    def write(self, text):
        if "Ctrl-C to stop" in text:
            os.write(marks, b"snapshot\n")
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


sys.stdout = Snapshots()
while True:
    code = main(["status", name, "--watch", "0.001"])
    os.write(marks, b"ended %d\n" % code)
"""


class _Lines:
    """The lines written to a pipe's read end, each awaited with a bound."""

    def __init__(self, fd):
        self.fd, self.buffer = fd, b""

    def next(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0))
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None  # the writer ended
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def test_status_watch_ends_on_every_ctrl_c_whatever_moment_it_comes(name, tmp_path):
    """Ctrl-C ends `status --watch` wherever its loop is (asking the engine in a forked
    child, printing, sleeping), with the last snapshot's exit status: here 150 runs, each
    sent SIGINT once at a different moment of its second snapshot or later. A SIGINT that
    came while the watch forked used to be raised inside an at-fork hook (logging's), where
    Python prints the KeyboardInterrupt and drops it: the watch went on for ever."""
    rounds = 150
    with TaskQueue(name, 1):
        reader, writer = os.pipe()
        with (tmp_path / "stderr").open("w") as err:
            watch = subprocess.Popen([sys.executable, "-c", _WATCH_AGAIN, name, str(writer)],
                                     pass_fds=(writer,), stdout=subprocess.DEVNULL, stderr=err)
        os.close(writer)
        lines = _Lines(reader)
        try:
            for k in range(rounds):
                # the first snapshot done (exit status 0 from then on), the second begun
                for _ in range(2):
                    line = lines.next(60)
                    assert line == "snapshot", (k, line, (tmp_path / "stderr").read_text())
                # 0 to 11 ms on: the loop (fork, ask, wait, print, sleep) takes ~10 ms
                time.sleep((k % 12) / 1000)
                watch.send_signal(signal.SIGINT)
                # a snapshot begun before the signal came may still be reported; one
                # that goes on past 30 s lost it
                deadline = time.monotonic() + 30
                line = "snapshot"
                while line == "snapshot":
                    line = lines.next(deadline - time.monotonic())
                assert line is not None, (f"Ctrl-C number {k + 1} was lost: the watch went "
                                          f"on for 30 s\n{(tmp_path / 'stderr').read_text()}")
                assert line == "ended 0", (k, line, (tmp_path / "stderr").read_text())
        finally:
            watch.kill()
            watch.wait(timeout=10)
            os.close(reader)
    stderr = (tmp_path / "stderr").read_text()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
