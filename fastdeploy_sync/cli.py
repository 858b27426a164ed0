"""``fastdeploy-sync`` command line.

    fastdeploy-sync status NAME [--dp-id N]   per-rank watermarks of a live (or stale) TP group

``status`` reads the group's shared memory without joining the group: it is safe to run
next to a running server, e.g. when a step seems stuck.
"""

import argparse
import sys

from . import __version__
from .shm import Segment, pid_alive
from .tp_group import (H_MAGIC, H_OWNER_PID, H_READY, H_TP_SIZE, MAGIC, R_ARRIVED, R_CONSUMED,
                       R_PID, R_RECEIVED, R_SLEEPING, RANK_BASE, RANK_STRIDE, group_shm_name)
from .transport import validate_name


def _status(args) -> int:
    validate_name(args.name, args.dp_id)
    shm_name = group_shm_name(args.name, args.dp_id)
    try:
        seg = Segment.attach(shm_name)
    except FileNotFoundError:
        print(f"{shm_name}: no such group on this node (TP=1 groups have no shared memory)")
        return 1
    try:
        v = seg.view
        if seg.size < RANK_BASE * 8 or v[H_MAGIC] != MAGIC or v[H_READY] != 1:
            print(f"{shm_name}: not a ready fastdeploy_sync group")
            return 1
        tp, owner = v[H_TP_SIZE], v[H_OWNER_PID]
        print(f"{shm_name}: tp_size={tp} owner pid {owner} "
              f"({'alive' if pid_alive(owner) else 'exited: stale, reclaimed by the next rank 0'})")
        print(f"{'rank':>4} {'pid':>8} {'alive':>5} {'received':>9} {'consumed':>9} "
              f"{'barrier gen':>11} {'sleeping':>8}")
        for r in range(tp):
            b = RANK_BASE + r * RANK_STRIDE
            pid = v[b + R_PID]
            print(f"{r:>4} {pid:>8} {str(pid_alive(pid)):>5} {v[b + R_RECEIVED]:>9} "
                  f"{v[b + R_CONSUMED]:>9} {v[b + R_ARRIVED]:>11} {v[b + R_SLEEPING]:>8}")
    finally:
        seg.close()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastdeploy-sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"fastdeploy_sync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="show a TP group's per-rank watermarks")
    status.add_argument("name")
    status.add_argument("--dp-id", type=int, default=0)
    status.set_defaults(run=_status)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
