"""TP groups that span nodes, through the drop-in with FastDeploy's ``nnode > 1`` loop
(rank 0 sets ``read_finish_flag``, ``paddle.distributed.barrier`` is the TP barrier, every
rank reads the flag, the reader with ``read_finish`` resets it).

Each simulated node is a mount + UTS namespace (``unshare -m -u``) with its own tmpfs on
/dev/shm and /tmp and its own hostname, so nothing node-local can be shared by accident;
the ranks meet over 127.0.0.1 (gloo, and the engine's tcp endpoint). Skipped where the
machine does not allow namespaces or paddle is missing."""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, TESTS
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.testing.fd_loops import STOP, batches, engine_loop, ids_of
from workers import free_ports

HERE = TESTS  # fd_node_worker.py


def _namespaces_allowed():
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    try:
        r = subprocess.run(["unshare", "-m", "-u", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm && hostname fdsync-probe"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    return None if r.returncode == 0 else \
        f"unshare -m -u with a tmpfs is not allowed here: {r.stderr.decode().strip()}"


_WHY_NOT = _namespaces_allowed()
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("paddle") is None,
                       reason="paddlepaddle is not installed"),
    pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT)),
]


def _private_tmp():
    """Shell that mounts a private tmpfs over /tmp, keeping visible what the ranks need
    that lives under the host's /tmp: this checkout (a CI clone may sit in /tmp; the
    editable install points into it), the Python environment (a virtual environment
    may live in /tmp) and any import path there. The host's /tmp is held
    through a bind mount under the node's own /dev/shm while those are bound back, then
    detached, so nothing else of it is reachable."""
    # sys.prefix / exec_prefix: a virtual environment under /tmp (its interpreter, its
    # pyvenv.cfg, its site-packages and the editable install's finder) must stay visible
    needed = {ROOT, sys.prefix, sys.exec_prefix,
              os.path.dirname(os.path.abspath(sys.executable)), *(p for p in sys.path if p)}
    under = sorted(p for p in needed if p.startswith("/tmp/") and os.path.isdir(p))
    keep = [p for p in under if not any(p.startswith(q + "/") for q in under)]
    parts = ["mkdir /dev/shm/.host-tmp", "mount --bind /tmp /dev/shm/.host-tmp",
             "mount -t tmpfs tmpfs /tmp"]
    for p in keep:
        rel = os.path.relpath(p, "/tmp")
        parts += [f"mkdir -p {shlex.quote(p)}",
                  f"mount --bind {shlex.quote('/dev/shm/.host-tmp/' + rel)} {shlex.quote(p)}"]
    parts += ["umount -l /dev/shm/.host-tmp", "rmdir /dev/shm/.host-tmp"]
    return " && ".join(parts)


def node_script(node, commands):
    """The shell script of one simulated node: its private /dev/shm, /tmp, /etc/hosts and
    hostname, then ``commands`` (one per rank) run side by side, each only once all of that
    is in place, and waited for."""
    # the new hostname must resolve (paddle's store looks it up): a private /etc/hosts.
    # The ranks are one group after the last "&&": "a && b & c" would start c at once,
    # beside the mounts (a rank then raced them, and once found its own script missing
    # from the private /tmp before this checkout was bound back into it)
    return (f"mount -t tmpfs -o size=256m tmpfs /dev/shm && {_private_tmp()} && "
            f"cp /etc/hosts /tmp/hosts && echo '127.0.0.1 {node}' >> /tmp/hosts && "
            f"mount --bind /tmp/hosts /etc/hosts && hostname {node} && "
            f"{{ {' & '.join(commands)} & wait; }}")


def start_node(node, ranks):
    """One simulated node: a private /dev/shm, /tmp and hostname, running ``ranks`` (a list
    of json argument dicts for tests/fd_node_worker.py) as processes. Returns the node's
    process and one pipe per rank carrying that rank's report: ranks of one node sharing a
    stdout interleaved their reports (a RESULT line printed inside another one)."""
    pipes = [os.pipe() for _ in ranks]
    script = node_script(node, [f"{sys.executable} {HERE}/fd_node_worker.py "
                                f"'{json.dumps(a)}' >/dev/fd/{w}"
                                for a, (_, w) in zip(ranks, pipes)])
    try:
        proc = subprocess.Popen(["unshare", "-m", "-u", "sh", "-c", script],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, pass_fds=[w for _, w in pipes])
    finally:
        for _, w in pipes:
            os.close(w)
    return proc, [r for r, _ in pipes]


class _PipeReader(threading.Thread):
    """Reads pipe ``fd`` until every writer closed it, while the node runs: a rank's
    report grows with the batches it took (a 20 000-batch soak's is megabytes), and a
    writer whose pipe is full waits for its reader, so nobody may read only at the end."""

    def __init__(self, fd):
        super().__init__(daemon=True)
        self.fd, self.chunks = fd, []
        self.start()

    def run(self):
        with os.fdopen(self.fd, "rb") as f:
            for chunk in iter(lambda: f.read(65536), b""):
                self.chunks.append(chunk)

    def text(self, timeout):
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError(f"a rank's report pipe was still open {timeout} s after its "
                               f"node exited")
        return b"".join(self.chunks).decode()


def run_multinode(name, tp, dp, n, layout, *, shape="develop", sync=False, timeout=150,
                  every_control=0):
    """``layout``: node index of each TP rank (same for every DP group). Runs FastDeploy's
    engine loop per DP group in this process (the engine's node) and returns the ranks'
    reports by (dp, rank)."""
    server = EngineWorkerQueue(address=("127.0.0.1", 0), is_server=True, num_client=tp,
                               local_data_parallel_size=dp, name=name)
    nodes, readers = [], []
    try:
        address = ["127.0.0.1", server.get_server_port()]
        endpoints = [f"127.0.0.1:{p}" for p in free_ports(tp * dp)]
        per_node = {}
        for d in range(dp):
            for r in range(tp):
                per_node.setdefault(layout[r], []).append(dict(
                    world_rank=d * tp + r, endpoints=endpoints, tp=tp, dp=d, rank=r,
                    address=address, name=name, shape=shape, sync=sync,
                    deadline_s=timeout - 20))
        for i, ranks in sorted(per_node.items()):
            proc, pipes = start_node(f"fdnode{i}", ranks)
            nodes.append(proc)
            readers.extend(_PipeReader(fd) for fd in pipes)  # each closes its pipe at EOF
        put = {d: batches(d, n, every_control=every_control, array_len=8 if n > 1000 else 64)
               for d in range(dp)}
        errors = []

        def engine(d):
            client = EngineWorkerQueue(address=tuple(address), num_client=tp, client_id=0,
                                       local_data_parallel_id=d, name=name)
            try:
                engine_loop(client, put[d], put_timeout=120)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=engine, args=(d,), daemon=True) for d in range(dp)]
        for t in threads:
            t.start()
        reports, logs = {}, []
        for p in nodes:
            _, err = p.communicate(timeout=timeout)
            logs.append(err[-3000:])
        for reader in readers:
            for line in reader.text(timeout=30).splitlines():
                if line.startswith("RESULT "):
                    rep = json.loads(line[len("RESULT "):])
                    reports[(rep["dp"], rep["rank"])] = rep
        for t in threads:
            t.join(timeout=30)
        bad = {k: v.get("error") for k, v in reports.items() if not v["ok"]}
        assert len(reports) == tp * dp and not bad, (bad, sorted(reports), logs)
        assert not errors, errors
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
        server.cleanup()
    for d in range(dp):
        ref = reports[(d, 0)]["calls"]
        for r in range(1, tp):
            assert reports[(d, r)]["calls"] == ref, f"dp {d}: rank {r} differs from rank 0"
        taken = [tuple(x) if isinstance(x, list) else x for _, _, ids in ref for x in ids]
        assert taken == ids_of(put[d]) + [STOP], taken[:10]
        # exactly one all_client_read per call is what resets the flag: covered by the loop
    return reports


def test_every_rank_of_a_node_starts_once_the_node_is_set_up():
    """Each rank's command runs after the node's mounts and hostname, whichever of its
    node's ranks it is (the second used to start beside them)."""
    marker = os.path.join(HERE, "fd_node_worker.py")
    probe = f"echo $(hostname) $(test -f {shlex.quote(marker)} && echo seen) $(ls -A /dev/shm | wc -l)"
    out = subprocess.run(["unshare", "-m", "-u", "sh", "-c",
                          node_script("fdnodeprobe", [probe] * 3)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["fdnodeprobe seen 0"] * 3, out.stdout


@pytest.mark.parametrize("shape,sync", [("develop", False), ("develop", True), ("v2x", False),
                                        ("v2x", True)],
                         ids=["develop-async", "develop-sync", "v2x-async", "v2x-sync"])
def test_tp2_across_two_nodes(name, loopback_tcp, shape, sync):
    """Before: the drop-in required a TP group's ranks to share a node (its coordination
    was node-local shared memory), so rank 1 on another node never attached rank 0's
    segment (TimeoutError after FD_SYNC_ATTACH_TIMEOUT). Both rank-0 checks: develop's
    exist_tasks() and 2.x's num_tasks() > 0."""
    reports = run_multinode(name, 2, 1, 30, [0, 1], shape=shape, sync=sync)
    assert {v["coordinator"] for v in reports.values()} == {"paddle"}
    assert {v["node"] for v in reports.values()} == {"fdnode0", "fdnode1"}


@pytest.mark.parametrize("shape", ["develop", "v2x"])
def test_tp4_across_two_nodes(name, loopback_tcp, shape):
    """TP=4 with two ranks on each node, develop's check and 2.x's (num_tasks() > 0)."""
    reports = run_multinode(name, 4, 1, 10, [0, 0, 1, 1], shape=shape)
    assert {v["coordinator"] for v in reports.values()} == {"paddle"}


def test_tcp_address_on_one_node_uses_shared_memory(name, loopback_tcp):
    """An address other than 0.0.0.0 with every rank on one node (paddle initialised):
    the automatic choice is node-local shared memory, and FastDeploy's nnode > 1 loop
    (read_finish_flag) works on it too."""
    reports = run_multinode(name, 2, 1, 20, [0, 0])
    assert {v["coordinator"] for v in reports.values()} == {"shm"}


# Bounds on a hang, not on speed: the run's own 240 s bound was longer than pytest's
# default timeout (180 s), which a loaded machine reached first.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reports_larger_than_a_pipe_are_read_while_the_nodes_run(name, loopback_tcp):
    """Each rank reports every batch it took through a pipe of its own. Before: the pipes
    were read only after the nodes exited, and a report above the pipe's 64 KiB capacity
    (about 3 000 batches) left its rank blocked in print() and the run waiting for it
    until its timeout (the 20 000-batch soak, tests/soak_dropin_multinode.py, hung)."""
    n = 6000
    reports = run_multinode(name, 2, 1, n, [0, 1], timeout=480)
    size = len(json.dumps(reports[(0, 1)]["calls"]))
    assert size > 2 * 65536, f"the report ({size} bytes) no longer exceeds a pipe"
