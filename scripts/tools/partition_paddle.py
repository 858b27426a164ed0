"""Cross-node failure detection of the paddle coordinator, on two real network stacks.

Needs root and iproute2; not part of CI. Builds two network namespaces joined by a veth
pair (10.213.77.1 and 10.213.77.2, addresses that exist only inside those namespaces),
runs one paddle.distributed (gloo) TP rank in each, both looping
``PaddleTPGroup.barrier(timeout)``, then injects one fault per scenario and prints how long
after the fault each rank raised, and what:

  kill            SIGKILL rank 1
  partition       a blackhole route to the peer in each namespace: every packet between
                  the ranks is dropped silently (the kernel here has no netem/iptables)
  partition-no-timeout  the same, with barrier(timeout=None): gloo's own bound applies
  link-down       the veth link set down on rank 1's side

Every wait is bounded; the namespaces and processes are removed on exit (try/finally),
also after Ctrl-C. Usage::

    sudo python scripts/tools/partition_paddle.py [--timeout 5] [--scenarios kill,partition,...]

``--overhead`` (no root, loopback) measures instead what honouring ``barrier(timeout)``
costs: the all-reduce inline (``timeout=None``) against the same all-reduce handed to
the helper thread (``timeout=5``), in alternating blocks of the same run.
"""

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

ADDRS = ("10.213.77.1", "10.213.77.2")
SCENARIOS = ("kill", "partition", "partition-no-timeout", "link-down")


def sh(*args):
    subprocess.run(args, check=True, timeout=20, stdout=subprocess.DEVNULL)


class Namespaces:
    """Two namespaces, a veth pair between them, one address each; removed by close()."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = (f"fdsync-a{tag}", f"fdsync-b{tag}")
        self.dev = (f"fdva{tag}", f"fdvb{tag}")  # <= 15 chars: the kernel's limit
        self.created = []
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
        sh("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
           "peer", "name", self.dev[1], "netns", self.ns[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDRS):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def reset(self):
        """Undo the faults of the last scenario."""
        for ns, dev, peer in zip(self.ns, self.dev, reversed(ADDRS)):
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], timeout=20)
            subprocess.run(["ip", "-n", ns, "route", "del", "blackhole", f"{peer}/32"],
                           timeout=20, stderr=subprocess.DEVNULL)

    def close(self):
        for ns in self.created:  # deleting a namespace deletes its end of the veth too
            subprocess.run(["ip", "netns", "del", ns], timeout=20)


def start_ranks(nets, port, timeout):
    endpoints = ",".join(f"{a}:{port + i}" for i, a in enumerate(ADDRS))
    procs = []
    for rank, (ns, dev) in enumerate(zip(nets.ns, nets.dev)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, PYTHONUNBUFFERED="1",
                   GLOG_minloglevel="2")  # gloo binds the veth, not the hostname's address
        cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__),
               "--rank", str(rank), "--endpoints", endpoints,
               "--timeout", str(-1 if timeout is None else timeout)]  # -1: None
        # ip netns exec execs the command: the pid is the rank's own
        log = tempfile.TemporaryFile(mode="w+")  # paddle's chatter; shown if a rank fails
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        p.log = log
        procs.append(p)
    return procs


def read_events(procs, want, deadline):
    """Collect one JSON event per rank whose event is in ``want``, until ``deadline``."""
    got, alive = {}, {p.stdout.fileno(): (r, p) for r, p in enumerate(procs)}
    while len(got) < len(procs) and alive and time.monotonic() < deadline:
        ready, _, _ = select.select(list(alive), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            rank, p = alive[fd]
            line = p.stdout.readline()
            if not line:
                del alive[fd]  # exited
                continue
            if line.startswith("{"):
                event = json.loads(line)
                if event["event"] in want:
                    got[rank] = event
    return got


def run_scenario(nets, scenario, port, timeout):
    barrier_timeout = None if scenario == "partition-no-timeout" else timeout
    procs = start_ranks(nets, port, barrier_timeout)
    try:
        ready = read_events(procs, {"ready"}, time.monotonic() + 90)
        if len(ready) != 2:
            print(f"{scenario}: ranks not ready within 90 s (ready: {sorted(ready)})")
            for rank, p in enumerate(procs):
                p.log.seek(0)
                print(f"  rank {rank} stderr tail:", *p.log.readlines()[-15:], sep="\n    ")
            return
        time.sleep(2.0)  # a couple of seconds of barriers
        fault_at = time.time()
        if scenario == "kill":
            procs[1].send_signal(signal.SIGKILL)
        elif scenario.startswith("partition"):
            for ns, peer in zip(nets.ns, reversed(ADDRS)):
                sh("ip", "-n", ns, "route", "add", "blackhole", f"{peer}/32")
        elif scenario == "link-down":
            sh("ip", "-n", nets.ns[1], "link", "set", nets.dev[1], "down")
        watched = procs[:1] if scenario == "kill" else procs
        raised = read_events(watched, {"raised", "error"}, time.monotonic() + 60)
        print(f"--- {scenario}: barrier(timeout={barrier_timeout}), fault at t=0")
        for rank in range(len(watched)):
            ev = raised.get(rank)
            if ev is None:
                print(f"  rank {rank}: raised nothing within 60 s")
                continue
            try:  # does the process still exit with an abandoned collective in flight?
                exited = f"exited rc={watched[rank].wait(timeout=10)}"
            except subprocess.TimeoutExpired:
                exited = "still running 10 s after raising"
            print(f"  rank {rank}: {ev['type']} after {ev['at'] - fault_at:.3f} s "
                  f"({ev['barriers']} barriers passed; cause {ev['cause']}; {exited})\n"
                  f"    {ev['message']}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            p.stdout.close()
            p.log.close()


def rank_main(rank, endpoints, timeout):
    """One TP rank: barriers until one raises; JSON lines on stdout."""
    eps = endpoints.split(",")
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(eps)),
                      PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=eps[rank],
                      PADDLE_DISTRI_BACKEND="gloo")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import paddle
    import paddle.distributed as dist

    from fastdeploy_sync.tp.paddle_group import PaddleTPGroup

    def emit(**event):
        print(json.dumps(event), flush=True)

    paddle.set_device("cpu")
    dist.init_parallel_env()
    group = PaddleTPGroup(len(eps), rank)
    group.barrier(timeout)
    emit(event="ready", incarnation=group.incarnation)
    n, deadline = 1, time.monotonic() + 120  # never unbounded
    try:
        while time.monotonic() < deadline:
            group.barrier(timeout)
            n += 1
            time.sleep(0.001)  # the model step
        emit(event="error", message="no failure within 120 s")
    except BaseException as exc:
        emit(event="raised", type=type(exc).__name__, message=str(exc), at=time.time(),
             cause=type(exc.__cause__).__name__, barriers=n)


def overhead_rank(rank, endpoints, rounds, block):
    """Alternate blocks of inline and helper-thread barriers; rank 0 prints the medians."""
    import statistics

    eps = endpoints.split(",")
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(eps)),
                      PADDLE_TRAINER_ENDPOINTS=endpoints, PADDLE_CURRENT_ENDPOINT=eps[rank],
                      PADDLE_DISTRI_BACKEND="gloo")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import paddle
    import paddle.distributed as dist

    from fastdeploy_sync.tp.paddle_group import PaddleTPGroup

    paddle.set_device("cpu")
    dist.init_parallel_env()
    group = PaddleTPGroup(len(eps), rank)
    times = {None: [], 5.0: []}
    for _ in range(50):
        group.barrier(5.0)  # warm up both paths
        group.barrier(None)
    for _ in range(rounds):
        for timeout in (None, 5.0):
            for _ in range(block):
                t = time.perf_counter()
                group.barrier(timeout)
                times[timeout].append(time.perf_counter() - t)
    group.close()
    if rank == 0:
        inline, threaded = (statistics.median(times[k]) * 1e6 for k in (None, 5.0))
        p99 = {k: sorted(v)[int(len(v) * 0.99)] * 1e6 for k, v in times.items()}
        print(f"barrier(timeout=None), inline all-reduce:   p50 {inline:7.1f} us  "
              f"p99 {p99[None]:7.1f} us  ({len(times[None])} barriers)")
        print(f"barrier(timeout=5), helper-thread all-reduce: p50 {threaded:7.1f} us  "
              f"p99 {p99[5.0]:7.1f} us  ({len(times[5.0])} barriers)")
        print(f"ratio threaded/inline (p50): {threaded / inline:.3f}  "
              f"(+{threaded - inline:.1f} us)")


def run_overhead(rounds, block):
    import socket

    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    endpoints = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    for s in socks:
        s.close()
    cmd = [sys.executable, os.path.abspath(__file__), "--overhead", "--endpoints", endpoints,
           "--overhead-rounds", str(rounds), "--overhead-block", str(block)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stderr=subprocess.DEVNULL,
                              env=dict(os.environ, GLOG_minloglevel="2")) for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=5.0, help="barrier(timeout) in seconds")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--overhead", action="store_true",
                    help="measure the helper thread's cost on loopback instead (no root)")
    ap.add_argument("--overhead-rounds", type=int, default=10)
    ap.add_argument("--overhead-block", type=int, default=200)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overhead and args.rank is not None:
        return overhead_rank(args.rank, args.endpoints, args.overhead_rounds,
                             args.overhead_block)
    if args.overhead:
        return run_overhead(args.overhead_rounds, args.overhead_block)
    if args.rank is not None:
        t = args.timeout if args.timeout >= 0 else None
        return rank_main(args.rank, args.endpoints, t)
    if os.geteuid() != 0:
        sys.exit("partition_paddle.py needs root (it creates network namespaces)")
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        sys.exit(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    import paddle  # noqa: F401  (fail here, not in the namespaces, if it is missing)

    nets = Namespaces()
    try:
        for i, scenario in enumerate(scenarios):
            run_scenario(nets, scenario, 36100 + 10 * i, args.timeout)
            nets.reset()
    finally:
        nets.close()


if __name__ == "__main__":
    main()
