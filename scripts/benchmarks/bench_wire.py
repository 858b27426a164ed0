"""What integrity and authentication cost on the wire, for one FastDeploy-like batch of 64
requests x 512 int64 token ids (256 KiB of arrays), measured side by side in one run:

  (a) codec: ``payload_checksum`` (xxh3_64, what the codec uses) next to the same
      length-prefixed scheme with zlib.crc32, per batch and per MiB, beside the cost of
      ``encode_payload`` and ``decode_payload`` (without and with the checksum);
  (b) transport: the batch sent engine -> worker over tcp://127.0.0.1 between two
      processes with raw pyzmq DEALER sockets, plain vs CURVE (``zmq.curve_keypair()``,
      ``curve_server`` / ``curve_serverkey``): round trip (batch out, 2-byte ack back)
      p50/p99, and throughput with up to ``--window`` batches in flight.

Asserts nothing: these are numbers to read, medians and ratios from the same run.

    PYTHONPATH=$PWD python scripts/benchmarks/bench_wire.py [--batches 1000] [--rounds 2]
"""

import argparse
import multiprocessing
import statistics
import struct
import sys
import time
import zlib

import numpy as np
import xxhash
import zmq

from fastdeploy_sync.wire import codec

MiB = 1 << 20
_LENGTH = struct.Struct("<Q")


def make_batch():
    requests = [{"request_id": f"req-{i}", "prompt_token_ids": np.arange(512, dtype=np.int64) + i,
                 "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256}}
                for i in range(64)]
    return requests, 64


make_batch_cached = make_batch()  # encode_payload is timed on one batch built once


def crc32_checksum(frames) -> int:
    """The alternative measured: zlib.crc32 over the same length-prefixed frames (32 bits)."""
    crc = 0
    for frame in frames:
        view = memoryview(frame)
        crc = zlib.crc32(view, zlib.crc32(_LENGTH.pack(view.nbytes), crc))
    return crc or 1


def interleaved_medians_us(fns, repeat):
    """Median µs per call of each fn, sampled round-robin (one call of each per round), so
    that load from other processes drifting during the run hits every row alike."""
    for _ in range(max(3, repeat // 20)):  # warm-up
        for fn in fns:
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for fn, into in zip(fns, samples):
            began = time.perf_counter()
            fn()
            into.append(time.perf_counter() - began)
    return [statistics.median(s) * 1e6 for s in samples]


def codec_section(repeat):
    frames = codec.encode_payload(make_batch())
    checksum = codec.payload_checksum(frames)
    size = sum(len(f) for f in frames)
    big = [np.random.default_rng(0).integers(0, 255, 16 * MiB, dtype=np.uint8).tobytes()]
    labels = ["payload_checksum (xxh3_64)", "same scheme with zlib.crc32", "encode_payload",
              "decode_payload, no checksum", "decode_payload, checksum verified"]
    per_batch = interleaved_medians_us([
        lambda: codec.payload_checksum(frames),
        lambda: crc32_checksum(frames),
        lambda: codec.encode_payload(make_batch_cached),
        lambda: codec.decode_payload(frames),
        lambda: codec.decode_payload(frames, checksum),
    ], repeat)
    per_big = interleaved_medians_us([lambda: codec.payload_checksum(big),
                                      lambda: crc32_checksum(big)], max(5, repeat // 100))
    print(f"(a) codec, one batch = {len(frames)} frames, {size} bytes "
          f"({size / MiB:.3f} MiB); medians of {repeat} calls, rows interleaved")
    print(f"  {'':<36} {'per batch':>12} {'per MiB':>12} {'per MiB (16 MiB frame)':>24}")
    for i, (label, us) in enumerate(zip(labels, per_batch)):
        big_us = f"{per_big[i] / 16:10.1f} µs" if i < 2 else ""
        print(f"  {label:<36} {us:9.1f} µs {us / (size / MiB):9.1f} µs {big_us:>24}")
    xxh3, crc, _, plain, checked = per_batch
    print(f"  crc32 / xxh3 per batch: {crc / xxh3:.1f}x; checksum / decode without it: "
          f"{xxh3 / plain:.2f}x; decode with / without checksum: {checked / plain:.2f}x")
    return size


def worker(endpoint, server_public, curve):
    """The worker side: a DEALER that connects, says hello, and acks every batch."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public
    sock.connect(endpoint)
    sock.send(b"hi")
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == b"stop":
                return
            sock.send(b"ok")
    finally:
        sock.close()
        ctx.term()


def transport_round(curve, frames, batches, window):
    """One engine/worker pair; returns (round-trip samples in s, pipelined batches/s)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    server_public = None
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = server_public, server_secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = multiprocessing.get_context("spawn").Process(
        target=worker, args=(f"tcp://127.0.0.1:{port}", server_public, curve), daemon=True)
    proc.start()
    try:
        if not sock.poll(30_000):
            raise SystemExit("the worker process did not connect within 30 s")
        sock.recv()
        message = [b"batch"] + frames

        def round_trip():
            sock.send_multipart(message, copy=False)
            if not sock.poll(10_000):
                raise SystemExit("no ack within 10 s")
            sock.recv()

        for _ in range(50):  # warm-up: connection, allocator, CURVE session
            round_trip()
        samples = []
        for _ in range(batches):
            began = time.perf_counter()
            round_trip()
            samples.append(time.perf_counter() - began)
        began = time.perf_counter()
        in_flight = 0
        for _ in range(batches):
            sock.send_multipart(message, copy=False)
            in_flight += 1
            if in_flight == window:
                sock.recv()
                in_flight -= 1
        for _ in range(in_flight):
            if not sock.poll(10_000):
                raise SystemExit("no ack within 10 s")
            sock.recv()
        throughput = batches / (time.perf_counter() - began)
        sock.send(b"stop")
        proc.join(10)
        return samples, throughput
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        sock.close()
        ctx.term()


def transport_section(size, batches, rounds, window):
    frames = codec.encode_payload(make_batch())
    print(f"\n(b) tcp://127.0.0.1, engine -> worker process, raw pyzmq DEALER pair, "
          f"{batches} batches x {rounds} rounds (plain and CURVE alternate), "
          f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}, CURVE available: {zmq.has('curve')}")
    pooled = {False: [], True: []}
    rates = {False: [], True: []}
    for _ in range(rounds):
        for curve in (False, True):
            samples, rate = transport_round(curve, frames, batches, window)
            pooled[curve] += samples
            rates[curve].append(rate)
    print(f"  {'':<8} {'round trip p50':>15} {'p99':>10} {'throughput':>24}")
    stats = {}
    for curve, label in ((False, "plain"), (True, "CURVE")):
        samples = sorted(pooled[curve])
        p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99)]
        rate = statistics.median(rates[curve])
        stats[curve] = (p50, p99, rate)
        print(f"  {label:<8} {p50 * 1e6:12.0f} µs {p99 * 1e6:7.0f} µs "
              f"{rate:8.0f} batches/s {rate * size / MiB:6.0f} MiB/s")
    (p50, p99, rate), (cp50, cp99, crate) = stats[False], stats[True]
    print(f"  CURVE / plain: round trip p50 {cp50 / p50:.2f}x (+{(cp50 - p50) * 1e6:.0f} µs), "
          f"p99 {cp99 / p99:.2f}x, throughput {crate / rate:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=int, default=8, help="batches in flight, throughput")
    parser.add_argument("--repeat", type=int, default=2000, help="calls per codec figure")
    args = parser.parse_args(argv)
    print(f"bench_wire: python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"xxhash {xxhash.VERSION}, zlib {zlib.ZLIB_RUNTIME_VERSION}")
    size = codec_section(args.repeat)
    transport_section(size, args.batches, args.rounds, args.window)


if __name__ == "__main__":
    main()
