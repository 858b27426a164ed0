"""``fastdeploy-sync`` command line.

    fastdeploy-sync status NAME [--dp-id N] [--watch [S]]  what the engine knows of every rank
                                              (state, watermarks) and the node-local group's
                                              shared memory, once or refreshed every S seconds
    fastdeploy-sync clean [NAME] [--dry-run]  list and remove names (shared memory, socket
                                              files) left by processes that exited
    fastdeploy-sync keys DIR [--force]        CURVE keys for tcp:// endpoints (see wire/auth.py)
    fastdeploy-sync profile [options]         CPU interruption per worker step: this library
                                              (async, sync) side by side with a FastDeploy-style
                                              multiprocessing.managers queue
    fastdeploy-sync run [--strict] -- COMMAND  run COMMAND (FastDeploy's launch) with the
                                              FastDeploy drop-in in it and in every Python
                                              process it starts
    fastdeploy-sync status                    the drop-in's processes on this node, their roles

``status NAME`` asks the engine (a STATUS message; tcp needs the worker keys) and reads the
group's shared memory without joining the group: it is safe to run next to a running
server, e.g. when a step seems stuck. ``clean`` never touches a name whose owner is alive
or that another user owns. ``profile`` starts its own engine and workers (real processes)
and needs nothing else running.

Exit status: 0 done; 1 the command ran and found a failure (no engine and no group, a lost
batch, keys not written); 2 a usage error (bad name, option or value), reported in one line.
"""

import argparse
import os
import sys
import time

from . import names
from .tp.layout import read_group
from .version import __version__
from .wire.endpoints import MAX_DP_ID, default_endpoint, validate_name


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``prog: error: ...; see prog --help``), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _queue_name(text):
    try:
        validate_name(text, 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("name=", "NAME ", 1)) from None
    return text


def _number(text, convert, ok, kind, bound="", shown=None):
    """``convert(text)`` if it converts and ``ok`` accepts it, else a one-line usage error:
    ``"<text>: expected <kind>"``, or ``<kind><bound>`` for a value out of bounds (named as
    ``shown(value)``, else as typed)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {kind}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{shown(value) if shown else repr(text)}: expected "
                                         f"{kind}{bound}")
    return value


def _dp_id(text):
    return _number(text, int, lambda v: 0 <= v <= MAX_DP_ID, f"an int in 0..{MAX_DP_ID}",
                   shown=str)


def _seconds(text):
    return _number(text, float, lambda v: v > 0, "a number of seconds", " > 0")


def _status(args) -> int:
    if args.name is None:
        return _dropin_processes(None, missing_is_failure=True)
    endpoint = args.endpoint or default_endpoint(args.name, args.dp_id)
    if args.watch is None:
        return _status_once(endpoint, args)
    # Refresh in a terminal until Ctrl-C; the exit status is the last snapshot's.
    tty = sys.stdout.isatty()
    code = 1
    try:
        while True:
            if tty:
                sys.stdout.write("\033[H\033[2J")  # cursor home, clear screen
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  fastdeploy-sync status "
                  f"{args.name} --dp-id {args.dp_id}  (every {args.watch:g} s, Ctrl-C to stop)")
            code = _status_once(endpoint, args)
            if not tty:
                print()
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code


def _status_once(endpoint, args) -> int:
    engine_seen = _engine_status(endpoint, args)
    group_seen = _group_status(args, engine_seen)
    _dropin_processes(args.name, missing_is_failure=False)
    return 0 if engine_seen or group_seen else 1


def _has_dropin_records() -> bool:
    from . import envs

    try:
        return any(e.endswith(".lock") for e in os.listdir(names.dropin_records(envs.ipc_dir())))
    except OSError:
        return False


def _dropin_processes(name, missing_is_failure: bool) -> int:
    """The drop-in's processes of this user on this node (of queue ``name``, or all): pid,
    whether it took the swap, its queues' roles, its command line. Without ``name`` an
    empty list says what to check, and is a failure; with ``name`` it prints nothing."""
    if name is not None and not _has_dropin_records():
        return 0  # nothing to list: spare status NAME the drop-in's imports
    from .fastdeploy.processes import records_dir, scan

    records = scan()
    if name is not None:
        records = [r for r in records if any(q.get("name") == name for q in r["queues"])]
        if not records:
            return 0
    if not records:
        print(f"no process of this user on this node uses the FastDeploy drop-in (none has a "
              f"record in {records_dir()}): start FastDeploy with 'fastdeploy-sync run -- "
              f"COMMAND', with the same FD_SYNC_IPC_DIR as this command")
        return 1 if missing_is_failure else 0
    print(f"FastDeploy drop-in processes on this node{f' (queue {name})' if name else ''}:")
    print(f"{'pid':>8} {'run':>8} {'swap':>4}  {'roles':<40} command")
    for r in records:
        roles = "; ".join(_role(q) for q in r["queues"]
                          if name is None or q.get("name") == name) or "(no role yet)"
        run = _text(r.get("run") or "-", 8)
        print(f"{r['pid']:>8} {run:>8} {'yes' if r.get('swapped') else 'no':>4}  "
              f"{_text(roles, 200):<40} {_text(' '.join(map(str, r.get('argv') or [])))}")
    return 0


def _role(queue) -> str:
    role, dp = queue.get("role"), queue.get("dp_id")
    what = {"worker": f"worker TP rank {queue.get('client_id')}",
            "server": "server + engine"}.get(role, str(role))
    return f"{what} of {queue.get('name')} dp {dp}"


def _text(value, limit: int = 200) -> str:
    """``value`` as one line that is safe on a terminal: what a peer sent is printed with
    its control characters (escape sequences, newlines) escaped, at most ``limit`` chars."""
    text = str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _engine_status(endpoint, args) -> bool:
    """What the engine knows: every rank's state and watermark (any coordinator). Whatever
    the endpoint answers is checked (``query_status_isolated``) and printed escaped
    (``_text``)."""
    from .errors import ProtocolError, TaskSyncError
    from .status_client import query_status_isolated

    try:  # in a child: a peer's endless reply cannot make this process grow (see there)
        st = query_status_isolated(endpoint, keys_dir=args.keys, timeout=args.timeout)
    except TimeoutError as exc:
        print(f"no engine answered: {_text(exc, 400)}")
        return False
    except ProtocolError as exc:
        print(f"no engine answered: {_text(exc, 400)}")
        return False
    except (OSError, TaskSyncError) as exc:
        print(f"no engine answered: asking {endpoint} failed: {_text(exc, 400)}")
        return False
    retired = st.get("groups_retired", 0)
    print(f"engine '{_text(st['name'], 64)}' dp_id={st['dp_id']} tp_size={st['tp_size']} at "
          f"{_text(st['endpoint'])} (pid {st['pid']}, instance {_text(st['engine'][:8])}): last "
          f"seq {st['last_seq']}, {st['retained']} retained, max_inflight "
          f"{st['max_inflight']}, worker group {_text(st['group'] or '(none connected)', 32)}, "
          f"{retired if isinstance(retired, int) else '?'} group(s) retired")
    print(f"{'rank':>4} {'state':<16} {'consumed':>9} {'silent s':>8} {'worker':>16}  reason")
    for r in st["ranks"]:
        silent = "-" if r["silent_s"] is None else f"{r['silent_s']:.1f}"
        print(f"{r['rank']:>4} {_text(r['state'], 16):<16} {r['consumed']:>9} {silent:>8} "
              f"{_text(r['worker'] or '-', 16):>16}  {_text(r['reason'] or '')}")
    return True


def _group_status(args, engine_seen: bool) -> bool:
    """What the node-local TP group's shared memory says (shm coordinator, TP > 1)."""
    shm_name = names.group_segment(args.name, args.dp_id)
    try:
        group = read_group(args.name, args.dp_id)
    except FileNotFoundError:
        if engine_seen:
            print(f"{shm_name}: no node-local group segment (TP=1, ranks on other nodes, or "
                  f"paddle-coordinated: the engine's view above is the whole story)")
        else:
            print(f"{shm_name}: no node-local group segment either: nothing of "
                  f"{args.name!r} dp {args.dp_id} runs on this node (check NAME, --dp-id, "
                  f"--endpoint; 'fastdeploy-sync clean --dry-run' lists leftovers)")
        return False
    except ValueError as exc:
        print(exc)
        return False
    # alive by the locks the owner and each rank hold, never by a pid: pids are reused,
    # and another pid namespace sharing /dev/shm (a sidecar container) sees other pids
    state = ("alive" if group.owner_alive else
             "exited: stale, reclaimed by the next rank 0 or fastdeploy-sync clean")
    print(f"{shm_name}: tp_size={group.tp_size} owner pid {group.owner_pid} ({state})")
    print(f"{'rank':>4} {'pid':>8} {'alive':>5} {'received':>9} {'consumed':>9} "
          f"{'barrier gen':>11} {'sleeping':>8}")
    for r in group.ranks:
        print(f"{r.rank:>4} {r.pid:>8} {str(r.alive):>5} {r.received:>9} "
              f"{r.consumed:>9} {r.arrived:>11} {r.sleeping:>8}")
    from .shm.batch_ring import published_rings

    for ring, epoch, published in published_rings(args.name, args.dp_id):
        print(f"{ring}: worker group {epoch}'s ring, published up to seq {published} (every "
              f"rank of the node can take those; 'received' counts what came over the socket)")
    return True


def _clean(args) -> int:
    from . import cleanup

    found = [item for item in cleanup.scan(args.name, args.dp_id) if item.state != "gone"]
    stale = [item for item in found if item.stale]
    removed = [] if args.dry_run else cleanup.remove(stale)
    removed_paths = {item.path for item in removed}
    for item in found:
        if not item.stale:
            label = "in use  " if item.state == "in use" else "not ours"
        elif args.dry_run:
            label = "stale   "
        else:
            label = "removed " if item.path in removed_paths else "kept    "
        print(f"{label} {cleanup.describe(item)}")
    scope = f"{args.name!r}" if args.name else "fastdeploy_sync"
    if args.dry_run:
        print(f"{len(stale)} stale name(s) of {scope} would be removed; "
              f"{len(found) - len(stale)} in use or not ours (nothing was changed)")
    else:
        print(f"removed {len(removed)} stale name(s) of {scope}; "
              f"{len(found) - len(stale)} in use or not ours, left alone")
    # Records of exited drop-in processes belong to no queue name: any clean removes them
    # (the directory is this user's own, and a record is stale only when its lock is free).
    if _has_dropin_records():
        from .fastdeploy.processes import prune, records_dir

        pruned = prune(dry_run=args.dry_run)
        if pruned:
            print(f"{'would remove' if args.dry_run else 'removed'} the records of {pruned} "
                  f"exited drop-in process(es) in {records_dir()}")
    return 0


def _keys(args) -> int:
    from .wire.auth import create_keys

    try:
        paths = create_keys(args.dir, force=args.force)
    except (FileExistsError, PermissionError) as exc:
        print(f"fastdeploy-sync keys: {exc.strerror or exc}", file=sys.stderr)
        return 1
    d = paths["dir"]
    print(f"keys written to {d} (mode 0700; secret files 0600)")
    print(f"  engine node : FD_SYNC_KEYS_DIR={d}  (reads server.key_secret, allowed_clients/)")
    print(f"  worker nodes: copy {paths['server_public']}, {paths['client_public']} and "
          f"{paths['client_secret']} (keep mode 0600) into a directory there and set "
          f"FD_SYNC_KEYS_DIR to it")
    return 0


def _run(args) -> int:
    from .fastdeploy.run import run

    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    return run(command, strict=args.strict)


def _add_profile_parser(sub):
    # The profiler's package: its parser imports nothing heavy; running it imports the rest.
    from .profiling.command import add_parser

    add_parser(sub)


def _add_queue_arguments(parser, name_help: str, dp_default, dp_help: str) -> None:
    """The optional NAME and --dp-id that name one queue (status, clean)."""
    parser.add_argument("name", metavar="NAME", type=_queue_name, nargs="?", help=name_help)
    parser.add_argument("--dp-id", type=_dp_id, default=dp_default, metavar="N", help=dp_help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastdeploy-sync",
                     description="Operate fastdeploy_sync task queues: inspect a TP group "
                                 "and the drop-in's processes (status), remove what killed "
                                 "processes left (clean), make CURVE keys (keys), measure "
                                 "task sync per step (profile), run FastDeploy with the "
                                 "drop-in (run). "
                                 "'fastdeploy-sync COMMAND --help' describes each.")
    parser.add_argument("--version", action="version", version=f"fastdeploy_sync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    _add_profile_parser(sub)

    status = sub.add_parser(
        "status", help="show what the engine and the TP group's shared memory say of every "
                       "rank, and the drop-in's processes",
        description="Ask the engine of queue NAME (DP group --dp-id) for every rank's state, "
                    "consumed watermark and silence, and read the node-local TP group's shared "
                    "memory (owner, each rank's pid, received and consumed watermarks, barrier "
                    "generation) without joining the group: safe next to a running server; "
                    "then list this node's processes that use the FastDeploy drop-in for "
                    "NAME. Exit status 0 if the engine or the group was found, 1 if neither. "
                    "Without NAME: list every process of this user on this node that uses the "
                    "drop-in (pid, whether it took the swap, each queue's role, command line); "
                    "exit status 1 if there is none.")
    _add_queue_arguments(
        status, "the queue name given to TaskQueue/TaskClient (FastDeploy drop-in: fdq<port>); "
                "omit it to list the drop-in's processes",
        0, f"data-parallel group id, 0..{MAX_DP_ID} (default 0)")
    status.add_argument("--endpoint", help="the engine's endpoint, e.g. tcp://10.0.0.1:5555 "
                                           "(default: the node-local ipc endpoint of NAME and "
                                           "--dp-id)")
    status.add_argument("--keys", metavar="DIR", help="worker keys for a tcp endpoint "
                                                      "(default: FD_SYNC_KEYS_DIR)")
    status.add_argument("--timeout", type=_seconds, default=2.0, metavar="S",
                        help="seconds to wait for the engine's answer (default 2)")
    status.add_argument("--watch", type=_seconds, nargs="?", const=2.0, default=None,
                        metavar="S", help="refresh every S seconds (default 2) until Ctrl-C")
    status.set_defaults(run=_status)

    clean = sub.add_parser(
        "clean", help="remove shared memory and socket files left by exited processes",
        description="List the names fastdeploy_sync keeps in /dev/shm (group segments, their "
                    "semaphores, ack boards, shared batches) and in the private ipc directory "
                    "(FD_SYNC_IPC_DIR; engine and producer socket files), and remove those whose "
                    "owner exited (a process killed by SIGKILL or SIGTERM leaves them). Names "
                    "whose owner is alive, and names of other users, are listed and never "
                    "touched.")
    _add_queue_arguments(
        clean, "only this queue's names (default: every fastdeploy_sync name of this user)",
        None, "only this data-parallel group (default: all)")
    clean.add_argument("--dry-run", action="store_true",
                       help="list what would be removed, remove nothing")
    clean.set_defaults(run=_clean)

    keys = sub.add_parser("keys", help="create CURVE keys for tcp:// endpoints",
                          description="Create a server and a client CURVE key pair and the "
                                      "engine's client allowlist in DIR (mode 0700). Refuses to "
                                      "overwrite existing keys unless --force.")
    keys.add_argument("dir", metavar="DIR",
                      help="directory to create the keys in (created with mode 0700)")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    keys.set_defaults(run=_keys)

    run = sub.add_parser(
        "run", help="run a command with the FastDeploy drop-in in it and in every Python "
                    "process it starts",
        description="Replace this process by COMMAND (same pid: signals reach it, its exit "
                    "status is the command's) with the drop-in's hook first on PYTHONPATH (the "
                    "rest kept; a sitecustomize it shadows still runs): every Python process of "
                    "the command swaps FastDeploy's EngineWorkerQueue for the drop-in when "
                    "FastDeploy imports it, and says so on stderr; 'fastdeploy-sync status' "
                    "lists them. A Python child started without the hook (an environment "
                    "without it, python -S/-I/-E) is reported on stderr by its parent. A "
                    "COMMAND that is such a Python is refused (exit status 2); a COMMAND that "
                    "cannot be found exits 127. Example: fastdeploy-sync run -- python -m "
                    "fastdeploy.entrypoints.openai.api_server --model ... --port ...")
    run.add_argument("--strict", action="store_true",
                     help="a Python child that would start without the hook fails to start "
                          "(PermissionError in the process that starts it) instead of being "
                          "reported")
    run.add_argument("command_line", metavar="COMMAND", nargs=argparse.REMAINDER,
                     help="the command and its arguments, after '--'")
    run.set_defaults(run=_run)
    return parser


def main(argv=None) -> int:
    """Run one command; returns the exit status. Failures print one line on stderr."""
    from .errors import TaskSyncError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, TaskSyncError) as exc:
        # Expected failures (permissions, a path too long, a private directory that is not
        # private...) are the operator's to fix: the message says how; no traceback.
        print(f"fastdeploy-sync {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
