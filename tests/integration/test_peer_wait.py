"""Rank 0's check and a peer still receiving the batch it holds (tp_group.wait_peers)."""


import pytest

from conftest import SPAWN
from fastdeploy_sync import TaskQueue
from workers import collect, peer_receiving_rank, wait_until


@pytest.mark.serial  # rank 1's I/O thread must hold the batch before its GIL hold ends
@pytest.mark.parametrize("async_prefetch", [True, False], ids=["async", "sync"])
def test_the_step_takes_a_batch_a_peer_is_receiving_when_rank_0_checks(name, procs, results,
                                                                        async_prefetch,
                                                                        monkeypatch,
                                                                        socket_delivery):
    """Batches over the socket (a tcp engine, or a batch that fit no ring slot). Before: rank
    0's check saw its peer lacking the batch, latched nothing and went to
    the barrier, where it waited for that peer anyway (the peer was receiving the batch
    before arriving); the batch waited for the next step. In the profile's loop with a
    GIL-holding step, whose peer receives only when its step blocks or ends, that made
    async delivery 1.37x sync's (the checks latched a batch both ranks held 2.2 ms after
    the second one had it, at the median). Now the check waits for the peer, which the
    barrier would have done: every rank takes the batch at this step."""
    # No heartbeat during the hold: a prefetch thread woken by one (not by the batch)
    # waits for the GIL as well, and the event loop cannot see that a batch came after it
    # woke (its readiness flag is the data socket's): that rank then arrives without it.
    monkeypatch.setenv("FD_SYNC_HEARTBEAT_INTERVAL", "20")
    monkeypatch.setenv("FD_SYNC_HEARTBEAT_TIMEOUT", "60")
    holding = SPAWN.RawValue("i", 0)
    hold_s = 0.5
    for rank in range(2):
        procs(peer_receiving_rank, results, rank, name, async_prefetch, holding, hold_s, 10.0)
    with TaskQueue(name, 2) as queue:
        collect(results, "ready", 1)  # rank 0; rank 1 says so through ``holding``
        # rank 1 is about to hold the GIL: a short poll, so the put lands while it holds it
        wait_until(lambda: holding.value, timeout=30, interval=0.0005,
                   what="rank 1 to begin holding the GIL")
        queue.put_tasks("batch 1", timeout=30)
        took = collect(results, "took", 2)
    found, elapsed, tasks0 = took[0]
    assert found is True, f"rank 0 latched nothing while its peer received the batch: {took}"
    assert tasks0 == ["batch 1"] and took[1][2] == ["batch 1"], took
    # the wait ended when the peer held the batch, not at the bound
    assert elapsed < 5.0, elapsed
