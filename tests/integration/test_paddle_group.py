"""TP ranks coordinated by paddle.distributed (the cross-node path), on real processes.

Both ranks run on this machine, but nothing of the node-local machinery is used: the
engine is on a tcp endpoint (ZeroMQ ACK messages, no ack board) and the ranks agree on
each step through gloo all-reduces, exactly as ranks on two nodes would.
"""

import importlib.util
import os
import signal
import socket
import time

import pytest

from fastdeploy_sync import TaskQueue
from workers import check_consistency, collect, free_ports, paddle_consistency_rank, put_with_pauses

pytestmark = pytest.mark.skipif(importlib.util.find_spec("paddle") is None,
                                reason="paddlepaddle is not installed")


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_ranks_coordinated_by_paddle_take_identical_batches(name, procs, results, loopback_tcp,
                                                           async_prefetch):
    tp, n = 2, 300
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(tp)]
    with TaskQueue(name, tp, endpoint="tcp://127.0.0.1:0", max_inflight=8) as queue:
        for rank in range(tp):
            procs(paddle_consistency_rank, results, rank, endpoints, name, tp, n,
                  async_prefetch, 11, skip_every=4, endpoint=queue.endpoint, deadline_s=150)
        put_with_pauses(queue, n, seed=11)
        steps = collect(results, "steps", tp, timeout=170)
        assert queue.stats()["acks"] > 0  # tcp: acknowledged by message
    check_consistency(steps, tp, n)
    assert all(step % 4 != 3 for step, _ in steps[0]), "a skipped step took batches"


# -- failures: the rank bodies (module level, so that spawn can import them) -------------

def _init_paddle(rank, endpoints):
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(endpoints)),
                      PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank], PADDLE_DISTRI_BACKEND="gloo")
    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    return dist


def _outcome(call):
    """Run ``call``; describe what it raised (classes by name: they cross a process)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "cause": type(exc.__cause__).__name__, "elapsed": time.monotonic() - start,
                "at": time.time()}
    return None


def _survivor_rank(out, rank, endpoints, survivor_barriers):
    """Build two groups (reporting both incarnations), pass a few barriers, then: rank 0
    waits in one more barrier (its peer will be gone) and reports what it raised, and
    what a later barrier raises; rank 1 reports its pid and idles until it is killed."""
    try:
        _init_paddle(rank, endpoints)
        from fastdeploy_sync.tp.paddle_group import PaddleTPGroup

        first, second = PaddleTPGroup(2, rank), PaddleTPGroup(2, rank)
        for _ in range(3):
            first.barrier(timeout=10)
        incarnations = (first.incarnation, second.incarnation)
        if rank == 1:
            out.put(("idle", rank, (os.getpid(), incarnations)))
            time.sleep(60)  # killed by the test long before
            return
        out.put(("waiting", rank, incarnations))
        raised = _outcome(lambda: first.barrier(timeout=survivor_barriers))
        again = _outcome(lambda: first.barrier(timeout=survivor_barriers))
        out.put(("raised", rank, (raised, again)))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))


def _silent_peer_rank(out, rank, endpoints, short_timeout):
    """Two groups on the same ranks; rank 1 then stays alive but silent. Rank 0 reports
    what barrier(short_timeout) raises on the first and barrier(None) on the second."""
    try:
        dist = _init_paddle(rank, endpoints)
        from fastdeploy_sync.tp.paddle_group import PaddleTPGroup

        bounded = PaddleTPGroup(2, rank)
        unbounded = PaddleTPGroup(2, rank, group=dist.new_group([0, 1]))
        bounded.barrier(timeout=10)
        unbounded.barrier()
        if rank == 1:
            out.put(("idle", rank, os.getpid()))
            time.sleep(90)  # alive and silent; killed by the test at the end
            return
        short = _outcome(lambda: bounded.barrier(timeout=short_timeout))
        gloo = _outcome(lambda: unbounded.barrier(timeout=None))
        out.put(("raised", rank, (short, gloo)))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))


# -- failures: the tests ------------------------------------------------------------------

def test_killed_peer_raises_peer_lost_naming_both_ranks(procs, results, doomed):
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
    survivor = procs(_survivor_rank, results, 0, endpoints, 20.0)
    procs(_survivor_rank, doomed, 1, endpoints, 20.0)
    pid, incarnations_1 = collect(doomed, "idle", 1, timeout=90)[1]
    incarnations_0 = collect(results, "waiting", 1, timeout=30)[0]

    # one agreed, non-zero 63-bit value per construction, different between constructions
    assert incarnations_0 == incarnations_1
    assert all(0 < v < 2**63 for v in incarnations_0)
    assert incarnations_0[0] != incarnations_0[1]

    time.sleep(0.5)  # rank 0 is inside the all-reduce by now
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    raised, again = collect(results, "raised", 1, timeout=40)[0]
    survivor.join(timeout=20)

    assert raised is not None, "barrier() returned although its peer was killed"
    print(f"raised {raised['at'] - killed_at:.3f}s after the kill: {raised['message']}")
    assert "PeerLostError" in raised["types"] and "BarrierTimeoutError" in raised["types"]
    assert "TaskSyncError" in raised["types"]
    msg = raised["message"]
    assert "TP rank 0 on " in msg and socket.gethostname() in msg and endpoints[0] in msg
    assert f"TP rank 1 (paddle endpoint {endpoints[1]})" in msg
    assert "restart every rank" in msg
    assert raised["cause"] == "RuntimeError"  # gloo's error, chained
    detected = raised["at"] - killed_at
    assert detected < 10.0, f"detected {detected:.1f}s after the kill"
    # the group stays unusable, and says so at once
    assert again is not None and "PeerLostError" in again["types"]
    assert "failed earlier" in again["message"] and again["elapsed"] < 1.0


@pytest.mark.slow
def test_barrier_timeout_is_honoured_and_gloo_bounds_the_rest(procs, results):
    """barrier(timeout) below gloo's bound is honoured; barrier(None) is bounded by gloo's
    own 30 s (GLOO_TIMEOUT_S). The peer stays alive: both are timeouts, not losses."""
    from fastdeploy_sync.tp.paddle_group import GLOO_TIMEOUT_S

    short_timeout = 1.0
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
    procs(_silent_peer_rank, results, 0, endpoints, short_timeout)
    peer = procs(_silent_peer_rank, results, 1, endpoints, short_timeout)
    try:
        collect(results, "idle", 1, timeout=90)
        short, gloo = collect(results, "raised", 1, timeout=GLOO_TIMEOUT_S + 40)[0]
        assert peer.is_alive()
    finally:
        peer.kill()

    for outcome in (short, gloo):
        assert outcome is not None, "barrier() returned although its peer was silent"
        assert "BarrierTimeoutError" in outcome["types"]
        assert "PeerLostError" not in outcome["types"]
        assert f"TP rank 1 (paddle endpoint {endpoints[1]})" in outcome["message"]
        assert "TP rank 0 on " in outcome["message"]
    print(f"barrier(timeout={short_timeout}) raised after {short['elapsed']:.2f}s; "
          f"barrier(None) after {gloo['elapsed']:.2f}s")
    assert short_timeout <= short["elapsed"] < short_timeout + 2.0
    assert GLOO_TIMEOUT_S * 0.95 <= gloo["elapsed"] < GLOO_TIMEOUT_S + 10.0
    assert gloo["cause"] == "RuntimeError"
    assert f"{GLOO_TIMEOUT_S:.0f}s timeout" in gloo["message"]
