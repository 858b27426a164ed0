"""Fuzz ``codec.decode_payload`` with mutated real task batches, in child processes.

Every input is a FastDeploy-like batch (``(list_of_requests, real_bsz)``, requests as
dicts or objects carrying numpy int64 token ids, some small enough to stay in the pickle
body) encoded by ``codec.encode_payload``, then mutated: bytes flipped, inserted or
truncated, frames dropped, duplicated or swapped, or replaced by random frames. Each input
goes through the real decode path (a 1-in-12 mutation changes a dtype code such as 'i8'
in the body: 'i8' -> 'm8' is the corruption measured to segfault numpy):

- default mode: with the checksum the encoder computed (what a worker does with a batch
  corrupted between the engine's encode and its decode). Every input must either decode
  (then the mutation must have been a no-op) or raise ``ProtocolError``; a crash, a hang,
  a ``MemoryError`` or a large allocation is a bug, and the exit status is 1.
- ``--recompute-checksum``: the checksum is recomputed over the mutated frames (what an
  authenticated but buggy or malicious sender could send). The unpickler then runs on the
  corrupted body: the counts of crashes, MemoryErrors and large allocations document the
  residual risk that only authentication covers. Nothing is asserted.

Decoding runs in child processes limited by ``RLIMIT_AS`` (``--mem-limit-gib``): a crash
kills a child, not this script; the supervisor records the input, then restarts the child
after it. A child that makes no progress for ``--hang-seconds`` is killed and counted as a
hang. Input ``i`` depends only on (seed, i, mode): ``--replay i`` shows its mutations and
decodes it alone.

    PYTHONPATH=$PWD python scripts/tools/fuzz_codec.py                       # 1 000 000 inputs
    PYTHONPATH=$PWD python scripts/tools/fuzz_codec.py --recompute-checksum --inputs 100000
    PYTHONPATH=$PWD python scripts/tools/fuzz_codec.py --replay 1234 --recompute-checksum
"""

import argparse
import collections
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from fastdeploy_sync.errors import ProtocolError
from fastdeploy_sync.wire import codec

# Counter slots, int64 each, in a file the child updates and the supervisor reads (also
# after the child died: the counts up to its last input survive it).
NEXT, NOOP, CHANGED, PROTOCOL, MEMORY, OTHER, BIG = range(7)
_NAMES = ["next", "decoded_noop", "decoded_changed", "protocol_error", "memory_error",
          "other_error", "big_alloc"]
EXIT_BIG_ALLOC = 3  # a child exits with this after an input raised its peak RSS a lot
POOL_SIZE = 48
_DTYPE_CODE = re.compile(rb"\x8c\x02[a-zA-Z?][0-9]")  # SHORT_BINUNICODE 'i8', 'f4'...


class Request:
    """A stand-in for FastDeploy's Request: an object whose attributes are pickled."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def make_batch(rng: random.Random, index: int):
    """One FastDeploy-like batch: (requests, real_bsz). Token lengths up to 512; arrays of
    fewer than 128 int64 stay inside the pickle body (numpy dtype unpickling in-band)."""
    count = 0 if index == 0 else rng.choice((1, 2, 8, 16, 32, 64))
    requests = []
    for n in range(count):
        length = rng.choice((1, 16, 100, 127, 128, 300, 512))
        fields = {
            "request_id": f"req-{index}-{n}",
            "prompt_token_ids": np.arange(length, dtype=np.int64) + rng.randrange(50000),
            "prompt_token_ids_len": length,
            "eos_token_ids": [2],
            "arrival_time": 1.7e9 + rng.random(),
            "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256,
                                "stop": ["</s>"], "seed": rng.randrange(1 << 31)},
            "multimodal_inputs": (None if rng.random() < 0.8 else
                                  {"image_features": np.zeros((4, 64), dtype=np.float32)}),
        }
        requests.append(Request(**fields) if rng.random() < 0.5 else fields)
    if index % 7 == 3:  # token ids as Python lists: all in the body
        for request in requests:
            ids = request["prompt_token_ids"] if isinstance(request, dict) else request.prompt_token_ids
            ids = ids.tolist()
            if isinstance(request, dict):
                request["prompt_token_ids"] = ids
            else:
                request.prompt_token_ids = ids
    return requests, count


def make_pool(seed: int):
    rng = random.Random(seed)
    pool = []
    for index in range(POOL_SIZE):
        frames = codec.encode_payload(make_batch(rng, index))
        pool.append((frames, codec.payload_checksum(frames)))
    return pool


def _pick_frame(rng, frames):
    # Half the mutations hit the pickle body: that is where the unpickler can be hurt.
    return 0 if rng.random() < 0.5 else rng.randrange(len(frames))


def mutate(rng: random.Random, frames: list, log: list) -> None:
    op = rng.choices(("flip", "insert", "truncate", "drop", "duplicate", "swap", "dtype"),
                     weights=(6, 1, 1, 1, 1, 1, 1))[0]
    if not frames:
        return
    if op == "dtype":
        # The corruption measured to segfault numpy: a dtype code changed in the body
        # ('i8' -> 'm8' is one flipped bit). Random flips hit it about once in 100 000.
        body = bytes(frames[0])
        found = [m.start() + 2 for m in _DTYPE_CODE.finditer(body)]
        if found:
            pos = rng.choice(found)
            code = rng.choice(b"mMOUSVbiufc?")
            frames[0] = body[:pos] + bytes((code,)) + body[pos + 1:]
            log.append(f"dtype code at byte {pos} of frame 0 -> {chr(code)!r}")
            return
        op = "flip"
    if op in ("flip", "insert", "truncate"):
        i = _pick_frame(rng, frames)
        frame = bytearray(frames[i])
        if op == "flip" and frame:
            for _ in range(rng.choice((1, 1, 1, 2, 4))):
                pos = rng.randrange(len(frame))
                frame[pos] ^= rng.randrange(1, 256)
                log.append(f"flip frame {i} byte {pos}")
        elif op == "insert":
            pos = rng.randrange(len(frame) + 1)
            frame[pos:pos] = rng.randbytes(rng.choice((1, 2, 8, 16)))
            log.append(f"insert into frame {i} at {pos}")
        elif op == "truncate" and frame:
            keep = rng.randrange(len(frame))
            del frame[keep:]
            log.append(f"truncate frame {i} to {keep}")
        frames[i] = frame
    elif op == "drop":
        i = rng.randrange(len(frames))
        del frames[i]
        log.append(f"drop frame {i}")
    elif op == "duplicate":
        i, j = rng.randrange(len(frames)), rng.randrange(len(frames) + 1)
        frames.insert(j, frames[i])
        log.append(f"duplicate frame {i} at {j}")
    else:
        i, j = rng.randrange(len(frames)), rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
        log.append(f"swap frames {i} and {j}")


def random_frames(rng: random.Random, log: list) -> list:
    """Frames of random bytes; half the time shaped enough to pass the cheap checks (a
    pickle-5 prefix and STOP, (start, length) pairs inside the data frame)."""
    count = rng.choice((1, 1, 2, 3, 3, 4))
    frames = [bytearray(rng.randbytes(rng.choice((0, 1, 8, 16, 64, rng.randrange(4096)))))
              for _ in range(count)]
    if rng.random() < 0.5 and len(frames[0]) >= 3:
        frames[0][:2], frames[0][-1:] = b"\x80\x05", b"."
    if count == 3 and rng.random() < 0.5:
        size = len(frames[2])
        pairs = []
        for _ in range(rng.choice((1, 2, 4))):
            start = rng.randrange(size + 1)
            pairs += [start, rng.randrange(size - start + 1)]
        frames[1] = bytearray(np.array(pairs, dtype=np.int64).tobytes())
    log.append(f"random frames of {[len(frame) for frame in frames]} bytes")
    return frames


def make_input(seed: int, index: int, pool: list, recompute: bool):
    """Input ``index``: (original frames, mutated frames, checksum to verify, mutation log).
    Depends only on (seed, index, recompute, the pool built from seed)."""
    rng = random.Random(seed * 1_000_003 + index)
    original, checksum = pool[rng.randrange(len(pool))]
    log = []
    if rng.random() < 0.1:
        frames = random_frames(rng, log)
    else:
        frames = list(original)
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            mutate(rng, frames, log)
    if recompute:
        checksum = codec.payload_checksum(frames)
    return original, frames, checksum, log


def _same(frames, original) -> bool:
    return len(frames) == len(original) and all(
        a is b or bytes(a) == b for a, b in zip(frames, original))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _limit_memory(gib: float) -> None:
    limit = int(gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_child(args) -> int:
    """Decode inputs [start, stop) in this process; see the module docstring."""
    _limit_memory(args.mem_limit_gib)
    pool = make_pool(args.seed)
    if args.counters:
        counters = np.memmap(args.counters, dtype=np.int64, mode="r+", shape=(len(_NAMES),))
    else:
        counters = np.zeros(len(_NAMES), dtype=np.int64)
    events = open(args.events, "a", buffering=1) if args.events else sys.stderr
    big = args.big_alloc_mib << 20
    baseline = _peak_rss_bytes()
    for index in range(args.start, args.stop):
        counters[NEXT] = index
        original, frames, checksum, log = make_input(args.seed, index, pool, args.recompute_checksum)
        try:
            codec.decode_payload(frames, checksum)
        except ProtocolError as exc:
            if isinstance(exc.__cause__, MemoryError):
                counters[MEMORY] += 1
                events.write(f"{index} memory_error {exc.__cause__!r}\n")
            else:
                counters[PROTOCOL] += 1
        except MemoryError as exc:
            counters[MEMORY] += 1
            events.write(f"{index} memory_error {exc!r}\n")
        except BaseException as exc:  # noqa: BLE001 -- anything but ProtocolError is a finding
            counters[OTHER] += 1
            events.write(f"{index} other_error {exc!r}\n")
        else:
            if _same(frames, original):
                counters[NOOP] += 1
            else:
                counters[CHANGED] += 1
                if not args.recompute_checksum:  # expected there: the checksum matches
                    events.write(f"{index} decoded_changed {'; '.join(log)}\n")
        del original, frames
        if _peak_rss_bytes() - baseline > big:
            counters[BIG] += 1
            events.write(f"{index} big_alloc peak RSS {_peak_rss_bytes() >> 20} MiB\n")
            counters[NEXT] = index + 1
            return EXIT_BIG_ALLOC  # restart: a fresh process has a fresh peak RSS
    counters[NEXT] = args.stop
    if not args.counters:
        print(json.dumps(dict(zip(_NAMES, counters.tolist()))))
    return 0


def supervise(args, start, stop, workdir, worker, report):
    """Run children over [start, stop) until done, restarting after each crash, hang or
    large allocation. Fills ``report`` with the counters and the inputs that crashed/hung."""
    counters_path = os.path.join(workdir, f"counters-{worker}")
    events_path = os.path.join(workdir, f"events-{worker}")
    stderr_path = os.path.join(workdir, f"stderr-{worker}")
    np.zeros(len(_NAMES), dtype=np.int64).tofile(counters_path)
    counters = np.memmap(counters_path, dtype=np.int64, mode="r+", shape=(len(_NAMES),))
    report.update(counters=counters, crashes=[], hangs=[], events_path=events_path,
                  stderr_path=stderr_path)
    position = start
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    while position < stop:
        command = [sys.executable, os.path.abspath(__file__), "--child", "--seed", str(args.seed),
                   "--start", str(position), "--stop", str(stop), "--counters", counters_path,
                   "--events", events_path, "--mem-limit-gib", str(args.mem_limit_gib),
                   "--big-alloc-mib", str(args.big_alloc_mib)]
        if args.recompute_checksum:
            command.append("--recompute-checksum")
        counters[NEXT] = position
        with open(stderr_path, "ab") as stderr:  # what the decoding printed, summarised by run()
            child = subprocess.Popen(command, env=env, stderr=stderr)
        last, last_change = int(counters[NEXT]), time.monotonic()
        while child.poll() is None:
            time.sleep(0.2)
            if int(counters[NEXT]) != last:
                last, last_change = int(counters[NEXT]), time.monotonic()
            elif time.monotonic() - last_change > args.hang_seconds:
                child.kill()
                child.wait()
                report["hangs"].append(last)
                break
        code = child.returncode
        at = int(counters[NEXT])
        if report["hangs"] and report["hangs"][-1] == at and code == -signal.SIGKILL:
            position = at + 1
        elif code == 0:
            position = stop
        elif code == EXIT_BIG_ALLOC:
            position = at
        elif code < 0:
            report["crashes"].append((at, signal.Signals(-code).name))
            position = at + 1
        else:
            with open(stderr_path, errors="replace") as f:
                tail = f.read()[-3000:]
            raise SystemExit(f"worker {worker}: child exited with status {code} at input {at}; "
                             f"replay with --replay {at}; its stderr ends:\n{tail}")


def run(args) -> int:
    workdir = tempfile.mkdtemp(prefix="fuzz_codec-")
    bounds = np.linspace(0, args.inputs, args.workers + 1).astype(int)
    reports = [{} for _ in range(args.workers)]
    threads = [threading.Thread(target=supervise, daemon=True,
                                args=(args, int(bounds[w]), int(bounds[w + 1]), workdir, w, reports[w]))
               for w in range(args.workers)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(1.0)
        if args.progress and all("counters" in r for r in reports):
            done = sum(int(r["counters"][NEXT]) - int(bounds[w]) for w, r in enumerate(reports))
            print(f"  {done} / {args.inputs} inputs, {done / (time.monotonic() - began):.0f}/s",
                  file=sys.stderr)
    seconds = time.monotonic() - began
    totals = dict.fromkeys(_NAMES[1:], 0)
    crashes, hangs, events, printed = [], [], [], collections.Counter()
    for report in reports:
        if "counters" not in report:
            return 2  # its thread raised; the message is above
        for slot, name in enumerate(_NAMES[1:], start=1):
            totals[name] += int(report["counters"][slot])
        crashes += report["crashes"]
        hangs += report["hangs"]
        if os.path.exists(report["events_path"]):
            with open(report["events_path"]) as f:
                events += f.read().splitlines()
        if os.path.exists(report["stderr_path"]):
            with open(report["stderr_path"], errors="replace") as f:
                printed.update(line.strip()[:160] for line in f if line.strip())
    totals["crashed"], totals["hung"] = len(crashes), len(hangs)
    mode = "checksum recomputed after mutating" if args.recompute_checksum else "checksum from the encoder"
    print(f"fuzz_codec: {args.inputs} inputs, seed {args.seed}, {mode}, {args.workers} workers, "
          f"RLIMIT_AS {args.mem_limit_gib} GiB per child")
    print(f"  {seconds:.1f} s, {args.inputs / seconds:.0f} inputs/s")
    labels = {"decoded_noop": "decoded (mutation was a no-op)",
              "decoded_changed": "decoded (bytes had changed)",
              "protocol_error": "ProtocolError",
              "memory_error": "MemoryError (asked beyond RLIMIT_AS)",
              "other_error": "other exception",
              "crashed": "crashed the child (signal)",
              "hung": f"hung (no progress for {args.hang_seconds} s)",
              "big_alloc": f"raised the child's peak RSS by > {args.big_alloc_mib} MiB"}
    for key, label in labels.items():
        print(f"  {label:<48} {totals[key]:>9}")
    if crashes:
        # Which mutations the crashing inputs carried (regenerated: inputs are deterministic).
        pool, kinds = make_pool(args.seed), collections.Counter()
        for at, name in crashes:
            log = make_input(args.seed, at, pool, args.recompute_checksum)[3]
            kinds[(name, " + ".join(sorted({entry.split(" at ")[0].split(" frame")[0]
                                             for entry in log})))] += 1
        for (name, kind), count in kinds.most_common():
            print(f"  {count:>9} x {name} after: {kind}")
        crashes.sort()
        print(f"  crashed at inputs {', '.join(str(at) for at, _ in crashes[:8])}"
              f"{', ...' if len(crashes) > 8 else ''}; replay one: --replay {crashes[0][0]}"
              f"{' --recompute-checksum' if args.recompute_checksum else ''} --seed {args.seed}")
    by_kind = collections.defaultdict(list)
    for line in events:
        index, kind, detail = (line.split(" ", 2) + [""])[:3]
        by_kind[kind].append((int(index), detail))
    for kind, found in sorted(by_kind.items()):
        found.sort()
        print(f"  {kind} at inputs {', '.join(str(i) for i, _ in found[:8])}"
              f"{', ...' if len(found) > 8 else ''} (first: {found[0][1][:120]})")
    if printed:
        print(f"  the children printed {sum(printed.values())} lines to stderr; most frequent:")
        for line, count in printed.most_common(5):
            print(f"  {count:>9} x {line}")
    if args.json:
        print(json.dumps(totals))
    findings = sum(totals[k] for k in ("decoded_changed", "memory_error", "other_error",
                                       "crashed", "hung", "big_alloc"))
    return 1 if findings and not args.recompute_checksum else 0


def replay(args) -> int:
    _limit_memory(args.mem_limit_gib)
    pool = make_pool(args.seed)
    original, frames, checksum, log = make_input(args.seed, args.replay, pool, args.recompute_checksum)
    print(f"input {args.replay}: {'; '.join(log)}")
    print(f"  original frames {[len(f) for f in original]} bytes, mutated {[len(f) for f in frames]}, "
          f"checksum {checksum:#018x}")
    sys.stdout.flush()
    baseline = _peak_rss_bytes()
    try:
        codec.decode_payload(frames, checksum)
    except ProtocolError as exc:
        print(f"  ProtocolError: {exc}; cause {exc.__cause__!r}")
    else:
        print(f"  decoded; frames unchanged: {_same(frames, original)}")
    print(f"  peak RSS +{(_peak_rss_bytes() - baseline) >> 20} MiB while decoding")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--recompute-checksum", action="store_true",
                        help="recompute the checksum after mutating (an authenticated sender "
                             "sending corrupted bytes); report, do not assert")
    parser.add_argument("--mem-limit-gib", type=float, default=2.0, help="RLIMIT_AS per child")
    parser.add_argument("--big-alloc-mib", type=int, default=256,
                        help="count an input that raises the child's peak RSS by more than this")
    parser.add_argument("--hang-seconds", type=float, default=10.0)
    parser.add_argument("--replay", type=int, help="show and decode this one input")
    parser.add_argument("--json", action="store_true", help="also print the totals as JSON")
    parser.add_argument("--progress", action="store_true")
    # A child decodes [start, stop); run by the supervisor (and by tests/unit/test_codec.py).
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--counters", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    if args.replay is not None:
        return replay(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
