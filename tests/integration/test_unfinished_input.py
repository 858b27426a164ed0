"""A peer that streams a multipart message and never sends its last frame cannot grow
the engine without bound (libzmq buffers such a message out of the engine's sight), on
the workers' endpoint or the producers'; the memory comes back once it is cut, and the
group is served throughout. A real engine process, a raw ZMTP peer."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine_peers import endless_peer
from fastdeploy_sync import names
from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path
from workers import wait_until

# An engine with a TP=1 rank in the same process: it puts a batch every 10 ms, the rank
# takes them, and it prints "<anon RSS MiB> <batches taken>" every 0.1 s until killed.
_ENGINE = textwrap.dedent("""
    import sys, threading, time
    from fastdeploy_sync import TaskClient, TaskQueue
    from fastdeploy_sync.wire.sockets import anon_rss_bytes
    name = sys.argv[1]
    taken = [0]
    with TaskQueue(name, 1) as queue, TaskClient(name, 1, 0) as client:
        def take():
            while True:
                taken[0] += len(client.sync_step(timeout=30))
                time.sleep(0.002)
        threading.Thread(target=take, daemon=True).start()
        while True:
            for _ in range(10):
                queue.put_tasks(b"x" * 1000, timeout=30)
                time.sleep(0.01)
            print(anon_rss_bytes() >> 20, taken[0], flush=True)
    """)


@pytest.mark.serial
@pytest.mark.parametrize("endpoint", ["workers", "producers"])
def test_an_endless_message_is_cut_and_its_memory_given_back(name, endpoint, monkeypatch):
    """3 s of an unfinished message at full speed: the engine's heap stays within a few
    hundred MiB of its start (before: +1.5 GiB in 2-3 s, kept after the peer left), the
    peer is cut, the heap comes back, and the rank keeps taking batches."""
    if endpoint == "producers":
        monkeypatch.setenv("FD_SYNC_MAX_MESSAGE_MB", "64")  # a PUT in flight: one batch
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, name], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    samples = []
    reader = threading.Thread(target=lambda: [samples.append(tuple(map(int, line.split())))
                                              for line in engine.stdout], daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(samples) >= 5, timeout=30, interval=0.05,
                   what="five heap samples from the engine",
                   seen=lambda: (samples, engine.stderr.read() if engine.poll() is not None else ""))
        start_heap, start_taken = samples[-1]
        path = ipc_path(default_endpoint(name, 0, "put" if endpoint == "producers" else ""))
        began = time.monotonic()
        sent, cut = endless_peer(path, 4000 if endpoint == "workers" else 60000, 3.0)
        during = list(samples)
        time.sleep(1.5)  # the cut peer's buffers freed and trimmed
        elapsed = time.monotonic() - began
        assert engine.poll() is None, engine.stderr.read()
        peak = max(heap for heap, _ in during) - start_heap
        assert cut, f"sent {sent} MiB and was never cut; heap +{peak} MiB"
        assert peak < 768, f"heap grew by {peak} MiB while {sent} MiB were sent"
        assert samples[-1][0] - start_heap < 64, (samples[-1], start_heap)
        print(f"{endpoint}: sent {sent} MiB, heap peak +{peak} MiB, after "
              f"+{samples[-1][0] - start_heap} MiB, {samples[-1][1] - start_taken} batches "
              f"taken in {elapsed:.1f} s")
        # a batch every 10 ms (and their puts' own time): served throughout
        assert samples[-1][1] - start_taken >= 40 * elapsed
    finally:
        engine.kill()
        engine.wait(timeout=30)
        reader.join(timeout=10)
        engine.stdout.close()
        engine.stderr.close()
        for path in [ipc_path(default_endpoint(name, 0)), ipc_path(default_endpoint(name, 0, "put"))]:
            if os.path.exists(path):
                os.unlink(path)
        for leftover in os.listdir(names.SHM_DIR):  # the killed engine's segments, semaphores
            parsed = names.parse_shm_entry(leftover)
            if parsed is not None and parsed.name == name:
                os.unlink(os.path.join(names.SHM_DIR, leftover))
