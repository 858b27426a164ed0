"""Payload codec: round trips, the checksum, structural checks, and a fuzz run in a child
process (a decoding bug shows as a failed test, not as a dead test runner)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import zmq

from conftest import ROOT
from fastdeploy_sync.wire import codec

FUZZ = os.path.join(ROOT, "scripts", "tools", "fuzz_codec.py")


def fastdeploy_batch(count=64, length=512):
    requests = [{"request_id": f"req-{i}", "prompt_token_ids": np.arange(length, dtype=np.int64) + i,
                 "sampling_params": {"temperature": 0.7, "top_p": 0.9}} for i in range(count)]
    return requests, count


def test_checksum_of_zmq_frames_bytes_and_memoryviews_agree():
    frames = codec.encode_payload(fastdeploy_batch())
    expected = codec.payload_checksum(frames)
    assert 0 < expected < 1 << 64
    assert codec.payload_checksum([memoryview(f) for f in frames]) == expected
    assert codec.payload_checksum([bytearray(f) for f in frames]) == expected
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://checksum")
        b.connect("inproc://checksum")
        a.send_multipart(frames)
        assert b.poll(5000)
        received = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        assert codec.payload_checksum(received) == expected
        requests, _ = codec.decode_payload(received, expected)
        assert not requests[0]["prompt_token_ids"].flags.writeable
        assert np.shares_memory(requests[0]["prompt_token_ids"],
                                np.frombuffer(received[2].buffer, dtype=np.uint8))
    finally:
        ctx.destroy(linger=0)


def test_fuzz_mutated_batches_in_a_child_process():
    """50 000 mutated real batches (and random frames) through decode_payload with the
    encoder's checksum, in a child limited to 2 GiB of address space: every input decodes
    unchanged or raises ProtocolError; no signal, no MemoryError, no large allocation."""
    inputs, seed = 50_000, 20261123
    command = [sys.executable, FUZZ, "--child", "--seed", str(seed), "--start", "0",
               "--stop", str(inputs), "--mem-limit-gib", "2", "--big-alloc-mib", "256"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    replay = f"replay: python scripts/tools/fuzz_codec.py --replay N --seed {seed}"
    assert child.returncode >= 0, (
        f"the decoding child died of {signal.Signals(-child.returncode).name}; {replay}\n{child.stderr}")
    assert child.returncode == 0, f"child exit status {child.returncode}; {replay}\n{child.stderr}"
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    assert counts["next"] == inputs
    for finding in ("memory_error", "other_error", "decoded_changed", "big_alloc"):
        assert counts[finding] == 0, f"{finding}: {counts}; {replay}\n{child.stderr}"
    assert counts["protocol_error"] + counts["decoded_noop"] == inputs
    # the mutations really change the input: only the rare no-op (a frame swapped with
    # itself, two flips of one byte that cancel) may decode
    assert counts["protocol_error"] >= 0.9 * inputs, counts
