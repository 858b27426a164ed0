"""Handled signals never break a wait: a rank blocked in ``barrier()``,
``wait_for_tasks()`` or rank 0's wait for its peers resumes after a signal that a handler
took (a Python handler, ``faulthandler.register``), bounded by its timeout; and what a
handler raises (``install_signal_cleanup``'s ``SystemExit``) ends the process as it should.
Real processes, real signals; every wait is bounded."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import TESTS
from fastdeploy_sync import names
from fastdeploy_sync.testing.processes import main_thread_state
from fastdeploy_sync.tp.shm_group import ShmTPGroup
from workers import collect, hold_group_rank, wait_until

PROCS = os.path.join(TESTS, "signal_procs.py")


@pytest.fixture
def usr1_counter():
    """A Python handler for SIGUSR1 in this (the main) thread that counts; restored after."""
    count = [0]
    before = signal.signal(signal.SIGUSR1, lambda s, f: count.__setitem__(0, count[0] + 1))
    yield count
    signal.signal(signal.SIGUSR1, before)


def _signal_me_every(interval, until):
    """SIGUSR1 to this process every ``interval`` s from a thread, until ``until()``."""
    def run():
        while not until():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(interval)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def rank0_with_a_peer(name, procs, results):
    group = ShmTPGroup(name, 0, 2, 0)
    peer = procs(hold_group_rank, results, 1, name, 2, 30)
    try:
        collect(results, "ready", 1)
        yield group
    finally:
        group.close()
        peer.kill()


@pytest.mark.parametrize("wait", ["barrier", "wait_received", "wait_peers"])
def test_a_handled_signal_resumes_a_wait_until_its_timeout(rank0_with_a_peer, usr1_counter,
                                                           wait):
    """Each semaphore wait of a rank, in the main thread, while SIGUSR1 arrives every 20 ms:
    the handler runs, the wait goes on and ends at its timeout (rank 1 never arrives nor
    receives). Before, posix_ipc's SignalError escaped at the first signal."""
    group = rank0_with_a_peer
    done = []
    sender = _signal_me_every(0.02, lambda: done)
    start = time.monotonic()
    try:
        if wait == "barrier":
            from fastdeploy_sync import BarrierTimeoutError

            with pytest.raises(BarrierTimeoutError, match="timed out after 0.600s"):
                group.barrier(timeout=0.6)
        elif wait == "wait_received":
            assert group.wait_received(1, 0.6) is False
        else:
            group.publish_received(1)  # rank 0 holds seq 1, rank 1 does not
            assert group.wait_peers(1, 0.6) == 0
    finally:
        done.append(True)
        sender.join(timeout=5)
    assert time.monotonic() - start >= 0.6  # it waited its whole timeout, not less
    assert usr1_counter[0] >= 5  # the signals came, and the handler ran


def test_an_exception_from_a_handler_is_raised_from_the_wait(rank0_with_a_peer):
    """posix_ipc runs Python handlers inside its wait and replaces what they raise by its
    own SignalError; the wait must raise what the handler raised (here SystemExit(143),
    as install_signal_cleanup's handler does), promptly, and leave this thread's signal
    mask as it was."""
    def leave(signum, frame):
        raise SystemExit(143)

    before = signal.signal(signal.SIGUSR1, leave)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
    start = time.monotonic()
    try:
        timer.start()
        with pytest.raises(SystemExit) as exc:
            rank0_with_a_peer.barrier(timeout=10)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, before)
    assert exc.value.code == 143
    assert time.monotonic() - start < 5  # within a slice of the signal, not at the timeout
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def _start(*argv):
    return subprocess.Popen([sys.executable, PROCS, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _expect_ready(p):
    line = p.stdout.readline().strip()
    if line != "ready":
        p.kill()
        raise AssertionError(f"not ready ({line!r}): {p.communicate(timeout=30)[1]}")


def _finish(procs):
    """Let each process end on its own (an engine that said "done" is closing its queue,
    which removes its names), for a bounded time, then kill what is left."""
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
        p.communicate(timeout=30)


@pytest.mark.parametrize("how", ["handler", "faulthandler"])
def test_a_group_takes_every_batch_while_its_ranks_are_signalled(name, how):
    """The issue's scenario: TP=2, 400 batches put with pauses (the ranks block between
    them), SIGUSR1 to both ranks every 2 ms, taken by a Python handler or by
    faulthandler.register (what operators use to dump stacks). Every rank takes all 400,
    in order. Before: SignalError, the group lost, 0-9 batches taken."""
    n = 400
    engine = _start("engine", name, str(n), "0.002")
    ranks = []
    try:
        _expect_ready(engine)
        ranks = [_start(f"rank{r}", name, str(n), how) for r in range(2)]
        for p in ranks:
            _expect_ready(p)
        sent = 0
        deadline = time.monotonic() + 90
        while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
            for p in ranks:
                if p.poll() is None:
                    try:
                        p.send_signal(signal.SIGUSR1)
                        sent += 1
                    except ProcessLookupError:
                        pass
            time.sleep(0.002)
        outs = [p.communicate(timeout=60) for p in ranks]
        codes = [p.returncode for p in ranks]
        assert codes == [0, 0], [(code, err[-3000:]) for code, (_, err) in zip(codes, outs)]
        for out, err in outs:
            took, _, signals = out.strip().partition(" signals ")
            assert took == "took " + ",".join(map(str, range(n))), (took[:200], err)
            if how == "handler":
                assert int(signals) > 0, out
        assert sent > 100
        assert engine.stdout.readline().strip() == "done"
    finally:
        _finish(ranks + [engine])


def test_sigterm_with_the_cleanup_handler_exits_143_from_a_blocked_wait(name):
    """Under install_signal_cleanup(), SIGTERM ends a rank blocked in wait_for_tasks()
    (rank 0) or in the async barrier (rank 1) with status 143 and no traceback, and its
    names are removed. Before: status 1 and a SignalError traceback."""
    engine = _start("engine", name, "0", "0")
    ranks = []
    try:
        _expect_ready(engine)
        ranks = [_start(f"idle{r}", name) for r in range(2)]
        for p in ranks:
            _expect_ready(p)
        for p in ranks:  # each main thread asleep: inside its blocking wait, not before it
            wait_until(lambda p=p: main_thread_state(p.pid) == "S", 30,
                       f"rank pid {p.pid} blocked in its wait",
                       seen=lambda p=p: main_thread_state(p.pid))
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        for r, p in enumerate(ranks):
            _, err = p.communicate(timeout=30)
            assert p.returncode == 128 + signal.SIGTERM, (r, p.returncode, err)
            assert "Traceback" not in err and "SignalError" not in err, err
    finally:
        _finish(ranks + [engine])
    # every name of the group but the engine's ack board (removed by the engine's own exit)
    assert not [entry for entry in os.listdir(names.SHM_DIR)
                if (parsed := names.parse_shm_entry(entry)) is not None and parsed.name == name
                and parsed.kind != ".acks"]
