"""The small costs the code's design rests on, measured on this machine.

    PYTHONPATH=$PWD python scripts/benchmarks/design_costs.py [--iters 20000]

The code states the choices (one memoryview slot instead of numpy indexing, what
``shm.order``'s fence costs, a ctypes ``pthread_sigmask``, xxh3 instead of crc32, the
codec's own array reduction, one data frame instead of one per array, the ack board
instead of an ACK message); docs/performance.md quotes what this prints. Each row: the
median of 7 blocks of ``--iters`` calls, per call.
"""

import argparse
import ctypes
import os
import pickle
import signal
import statistics
import sys
import time
import uuid
import zlib

import numpy as np
import zmq

from fastdeploy_sync.wire import codec
from fastdeploy_sync.wire.sockets import ReadinessPoll, anon_rss_bytes

ns = time.perf_counter_ns


def per_call(fn, iters, blocks=7):
    """Median over ``blocks`` of the mean ns per call of ``fn`` (called ``iters`` times)."""
    means = []
    for _ in range(blocks):
        t0 = ns()
        for _ in range(iters):
            fn()
        means.append((ns() - t0) / iters)
    return statistics.median(means)


def row(label, value_ns):
    unit, value = ("ns", value_ns) if value_ns < 1e4 else ("us", value_ns / 1e3)
    print(f"  {label:<62} {value:10.2f} {unit}")


def batch():
    return ([{"prompt_token_ids": np.arange(i, i + 512, dtype=np.int64)} for i in range(64)], 64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20000)
    n = ap.parse_args().iters
    print(f"design_costs: python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"{os.cpu_count()} cores")

    print("\nshared memory slot reads (shm.segment.Segment.view)")
    raw = bytearray(4096)
    view = memoryview(raw).cast("q")
    arr = np.frombuffer(raw, dtype=np.int64)
    row("memoryview int64 slot read", per_call(lambda: view[5], n))
    row("numpy int64 scalar read", per_call(lambda: arr[5], n))
    poll = ReadinessPoll([os.pipe()[0]])
    row("ReadinessPoll.ready(0) (one revents read)", per_call(lambda: poll.ready(0), n))

    print("\nmemory order on a shared word (shm.order): the fence is two lock round trips")
    import threading

    from fastdeploy_sync.shm import order
    lock = threading.Lock()

    def one_pair():
        lock.acquire()
        lock.release()

    def plain_store():
        view[5] = 1

    row("plain store", per_call(plain_store, n))
    row("order.store_release", per_call(lambda: order.store_release(view, 5, 1), n))
    row("order.load_acquire", per_call(lambda: order.load_acquire(view, 5), n))
    row("order.fence", per_call(order.fence, n))
    row("one lock acquire+release (vLLM's fence; not one here)", per_call(one_pair, n))

    print("\nsignal masks around a semaphore wait (shm.semaphores)")
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.pthread_sigmask
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    mask_t = ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))
    blocked, saved = mask_t(), mask_t()
    blocked[0] = 1 << (signal.SIGUSR1 - 1)

    def ctypes_pair():
        call(signal.SIG_BLOCK, ctypes.byref(blocked), ctypes.byref(saved))
        call(signal.SIG_SETMASK, ctypes.byref(saved), None)

    def python_pair():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        signal.pthread_sigmask(signal.SIG_SETMASK, old)

    row("ctypes pthread_sigmask block + restore", per_call(ctypes_pair, n))
    row("signal.pthread_sigmask block + restore", per_call(python_pair, n // 10))
    every = sorted(signal.valid_signals())
    row("signal.getsignal of every signal", per_call(lambda: [signal.getsignal(s) for s in every
                                                               if s not in (0,)], n // 100))

    print("\nprocess memory read (wire.sockets.anon_rss_bytes, /proc/self/statm)")
    row("anon_rss_bytes()", per_call(anon_rss_bytes, n // 10))

    print("\nchecksums over a 64 x 512 int64 batch's frames (wire.codec)")
    frames = codec.encode_payload(batch())
    size = sum(len(f) for f in frames)
    row(f"xxh3_64 payload_checksum ({size >> 10} KiB)",
        per_call(lambda: codec.payload_checksum(frames), n // 100))
    row("zlib.crc32 over the same bytes",
        per_call(lambda: [zlib.crc32(f) for f in frames], n // 100))

    print("\nthe batch's 64 arrays: the codec's reduction vs numpy's own (pickle 5, out of band)")
    tasks = batch()
    row("codec encode_payload + decode_payload",
        per_call(lambda: codec.decode_payload(codec.encode_payload(tasks)), n // 100))

    def numpy_reduction():
        buffers = []
        body = pickle.dumps(tasks, protocol=5, buffer_callback=buffers.append)
        pickle.loads(body, buffers=[b.raw() for b in buffers])

    row("pickle 5 with numpy's reduction, dumps + loads", per_call(numpy_reduction, n // 100))

    print("\nZeroMQ over ipc, a connected DEALER -> ROUTER (the ACK path and the frame count)")
    ctx = zmq.Context()
    path = f"ipc:///tmp/fdsync-design-costs-{uuid.uuid4().hex[:8]}.ipc"
    router = ctx.socket(zmq.ROUTER)
    router.bind(path)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(path)
    dealer.send(b"hello")
    router.recv_multipart()
    header = bytes(64)

    def ack_and_drain():
        dealer.send(header, zmq.NOBLOCK)
        router.recv_multipart()

    row("ACK send + its receive (a 64-byte message)", per_call(ack_and_drain, n // 10))
    board = memoryview(bytearray(64)).cast("q")

    def board_store():
        board[3] = 7

    row("ack board store (one int64)", per_call(board_store, n))
    parts = [os.urandom(4096) for _ in range(64)]
    one = b"".join(parts)
    row("one 256 KiB frame: send + receive",
        per_call(lambda: (dealer.send(one), router.recv_multipart(copy=False)), n // 100))
    row("64 frames of 4 KiB: send + receive",
        per_call(lambda: (dealer.send_multipart(parts), router.recv_multipart(copy=False)),
                 n // 100))
    dealer.close(0)
    router.close(0)
    ctx.term()
    try:
        os.unlink(path[len("ipc://"):])
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    main()
