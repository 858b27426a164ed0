"""TP ranks coordinated by paddle.distributed (the cross-node path), on real processes.

Both ranks run on this machine, but nothing of the node-local machinery is used: the
engine is on a tcp endpoint (ZeroMQ ACK messages, no ack board) and the ranks agree on
each step through gloo all-reduces, exactly as ranks on two nodes would.
"""

import importlib.util
import socket

import pytest

from fastdeploy_sync import TaskQueue

from workers import check_consistency, collect, paddle_consistency_rank, put_with_pauses

pytestmark = pytest.mark.skipif(importlib.util.find_spec("paddle") is None,
                                reason="paddlepaddle is not installed")


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_ranks_coordinated_by_paddle_take_identical_batches(name, procs, results,
                                                           async_prefetch):
    tp, n = 2, 300
    endpoints = [f"127.0.0.1:{port}" for port in _free_ports(tp)]
    with TaskQueue(name, tp, endpoint="tcp://127.0.0.1:0", max_inflight=8) as queue:
        for rank in range(tp):
            procs(paddle_consistency_rank, results, rank, endpoints, name, tp, n,
                  async_prefetch, 11, skip_every=4, endpoint=queue.endpoint, deadline_s=150)
        put_with_pauses(queue, n, seed=11)
        steps = collect(results, "steps", tp, timeout=170)
        assert queue.stats()["acks"] > 0  # tcp: acknowledged by message
    check_consistency(steps, tp, n)
    assert all(step % 4 != 3 for step, _ in steps[0]), "a skipped step took batches"
