"""Shared memory that has no room (Docker's 64 MiB /dev/shm, a /dev/shm that fills up):
every batch is still delivered, over the socket when shared memory cannot hold it, none
lost or twice, and no process dies of SIGBUS. Each scenario runs an engine and its TP
workers in a private mount namespace with a small tmpfs over /dev/shm
(tests/small_shm_scenario.py); skipped where the machine does not allow it."""

import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import TESTS
from fastdeploy_sync import names
from fastdeploy_sync.engine import encoder as batch_encoder
from fastdeploy_sync.shm import payload as payload_shm
from fastdeploy_sync.shm.pool import PayloadPool

SCENARIO = os.path.join(TESTS, "small_shm_scenario.py")


def _private_shm_allowed():
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -m failed: {exc}"
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs over /dev/shm here: {probe.stderr.strip()}"
    return None


_SKIP = _private_shm_allowed()
needs_private_shm = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def run_scenario(scenario, name, size, env=None):
    """Run the scenario with a ``size`` tmpfs over /dev/shm; return its JSON report."""
    command = ["unshare", "-m", "sh", "-c",
               f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
               f"exec {sys.executable} {SCENARIO} {scenario} {name}"]
    child = subprocess.run(command, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **(env or {})))
    assert child.returncode == 0, (
        f"scenario {scenario} exited with {child.returncode} (SIGBUS is -7 or 135)\n"
        f"{child.stdout[-3000:]}\n{child.stderr[-5000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["error"] is None, report["error"]
    assert report["exitcodes"] == [0, 0], report
    return report


def assert_every_batch_delivered_once_in_order(report):
    for rank, took in report["took"].items():
        assert took == report["expected"], f"rank {rank} took other batches"


@needs_private_shm
def test_batches_larger_than_a_64_mib_dev_shm_arrive_over_the_socket(name):
    """Docker's default: the pool is sized down to half of /dev/shm (WARNING); batches
    that fit it use it, a 48 MiB and a 100 MiB batch arrive over the socket (WARNING)."""
    report = run_scenario("larger-than-room", name, "64m")
    assert report["shm_size_mib"] == 64
    assert_every_batch_delivered_once_in_order(report)
    stats = report["stats"]
    assert stats["shm_pool_bytes"] == 32 << 20, stats
    assert stats["shm_pool_batches"] >= 3 and stats["shm_socket_fallbacks"] >= 2, stats
    log = "\n".join(report["log"])
    assert "sized down to 32 MiB" in log and "goes over the socket" in log, log
    ours = [n for n in report["left"] if "fdsync" in n]
    assert ours == [], report["left"]  # close() removed every name of ours


@needs_private_shm
def test_a_dev_shm_too_small_for_a_pool_disables_it(name):
    report = run_scenario("no-pool", name, "1m")
    assert_every_batch_delivered_once_in_order(report)
    stats = report["stats"]
    assert "shm_pool_bytes" not in stats and stats["shm_socket_fallbacks"] == 3, stats
    assert "no shared-memory pool" in "\n".join(report["log"])
    # no room for the worker group's ring either: every batch came over the socket
    assert "shm_ring_batches" not in stats, stats
    assert "no shared-memory ring" in "\n".join(report["log"])


@needs_private_shm
def test_a_dev_shm_that_fills_up_mid_run(name):
    """Another process fills /dev/shm while batches flow: the pool's space was reserved
    when it was created, so batches that fit it keep using it; the others arrive over
    the socket; once the room is back, nothing is lost or repeated."""
    report = run_scenario("fills-mid-run", name, "64m")
    assert_every_batch_delivered_once_in_order(report)
    stats = report["stats"]
    assert stats["shm_pool_batches"] >= 6 and stats["shm_socket_fallbacks"] >= 1, stats


def test_a_segment_that_finds_no_room_is_enospc_and_leaves_no_name(name, tmp_path,
                                                                  monkeypatch):
    """posix_fallocate reserves every page when a segment is created: no room is an
    OSError then (and the name is removed), never a SIGBUS when a rank reads it."""
    monkeypatch.setattr(os, "posix_fallocate",
                        lambda fd, offset, size: (_ for _ in ()).throw(
                            OSError(errno.ENOSPC, "No space left on device")))
    seg = names.batch_segment(name, 0, 1)
    with pytest.raises(OSError) as info:
        payload_shm.SharedPayload.create(seg, 1 << 20)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        PayloadPool.create(names.pool(name, 0, 1), 2, 1 << 20)
    # the name fixture checks that neither name is left behind


def test_the_encoder_sends_over_the_socket_when_shared_memory_fails(name, monkeypatch):
    """The room check passed, then /dev/shm filled before the segment was reserved (and
    the pool could not be created either): the batch goes over the socket, complete."""
    monkeypatch.setenv("FD_SYNC_SHM_PAYLOAD_MIN_KB", "64")
    monkeypatch.setattr(os, "posix_fallocate",
                        lambda fd, offset, size: (_ for _ in ()).throw(
                            OSError(errno.ENOSPC, "No space left on device")))
    encoder = batch_encoder.BatchEncoder(name, 0, 2, node_local=True,
                                         max_message_bytes=1 << 30)
    try:
        tasks = {"features": np.arange(1 << 16, dtype=np.int64)}
        batch = encoder.encode(tasks)
        assert batch.shared is None and len(batch.frames) == 3
        from fastdeploy_sync.wire import codec

        decoded = codec.decode_payload(batch.frames, batch.checksum)
        np.testing.assert_array_equal(decoded["features"], tasks["features"])
        assert encoder.kept.stats()["shm_socket_fallbacks"] == 1
    finally:
        encoder.kept.close()
