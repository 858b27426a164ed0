#!/usr/bin/env python3
"""20 000-batch consistency soak of the drop-in with a TP group across two simulated nodes.

    python tests/soak_dropin_multinode.py --batches 20000 --tp 2 [--sync] [--shape v2x]

Each node is a mount + UTS namespace with its own /dev/shm, /tmp and hostname (as in
tests/integration/test_fastdeploy_multinode.py, whose harness this runs): FastDeploy's ``nnode > 1``
loop, paddle.distributed over gloo on 127.0.0.1, the engine on a tcp address in this
process. Checks that every rank took identical batches at identical steps and calls,
every batch once, in order (every 97th a ControlRequest). Needs root for unshare/mount.
It lives in tests/, beside the harness it runs (a test module's), not in scripts/.
"""

import argparse
import os
import sys
import time
import uuid

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "integration")]
os.environ.setdefault("FD_SYNC_INSECURE_TCP", "1")  # loopback only

from test_fastdeploy_multinode import _WHY_NOT, run_multinode  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--shape", default="develop", choices=["develop", "v2x"])
    args = ap.parse_args()
    if _WHY_NOT:
        raise SystemExit(f"cannot simulate nodes here: {_WHY_NOT}")
    layout = [r * 2 // args.tp for r in range(args.tp)]  # half the ranks on each node
    t0 = time.monotonic()
    reports = run_multinode("s" + uuid.uuid4().hex[:10], args.tp, 1, args.batches, layout,
                            shape=args.shape, sync=args.sync,
                            timeout=args.batches / 20 + 120, every_control=97)
    calls = reports[(0, 0)]["calls"]
    print(f"PASS shape={args.shape} {'sync' if args.sync else 'async'} TP={args.tp} over "
          f"nodes {sorted({v['node'] for v in reports.values()})} "
          f"({sorted({v['coordinator'] for v in reports.values()})}): {args.batches} "
          f"batches in {len(calls)} get_tasks() calls over {reports[(0, 0)]['steps']} steps, "
          f"identical on every rank, in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
