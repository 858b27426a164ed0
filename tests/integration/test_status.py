"""STATUS: what scraping the engine's status costs a live group, and what a hostile
endpoint can do to ``query_status``/``fastdeploy-sync status``. Real engine, ranks and
sockets; every wait is bounded."""

import time

from conftest import SPAWN, needs_pid_namespace
from fastdeploy_sync import TaskClient, TaskQueue
from fastdeploy_sync.engine.queue import query_status
from fastdeploy_sync.testing.processes import children, report_errors
from workers import collect, wait_until


@report_errors
def connected_rank(out, rank, name, tp, leave):
    """Join the group, say so, stay until ``leave`` is set (at most 60 s), then close."""
    with TaskClient(name, tp, rank):
        out.put(("ready", rank, None))
        leave.wait(60)


def test_scraping_the_status_does_not_make_the_engine_probe_its_ranks(name, procs, results):
    """Each scrape is a connection that comes and goes; a dropped connection used to make
    the engine probe (PONG) every rank, up to 20 times a second, waking their receiving
    threads. Only a rank's own connection dropping does that now: 30 scrapes in ~0.8 s
    cost the ranks no more probes than the heartbeat tick's (one per rank per second)."""
    leave = SPAWN.Event()
    with TaskQueue(name, 2) as queue:
        try:
            for rank in range(2):
                procs(connected_rank, results, rank, name, 2, leave)
            collect(results, "ready", 2)
            assert wait_until(lambda: all(r["state"] == "connected" for r in queue.ranks()), 10)
            before = queue.stats().get("probes", 0)
            start = time.monotonic()
            for _ in range(30):
                assert query_status(queue.endpoint, timeout=5)["tp_size"] == 2
                time.sleep(0.025)
            time.sleep(0.1)  # the last drop reported
            elapsed = time.monotonic() - start
            probes = queue.stats().get("probes", 0) - before
            assert probes <= 2 * (elapsed / queue.heartbeat.interval + 2), (probes, elapsed)
        finally:
            leave.set()


# -- a hostile endpoint ----------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
import zmq  # noqa: E402

from fastdeploy_sync.wire import codec  # noqa: E402
from fastdeploy_sync.wire.endpoints import default_endpoint, ipc_path  # noqa: E402

_FULL_ID = "5eed5eed5eed5eed"


def _status_cli(name, timeout=30):
    """`fastdeploy-sync status NAME` in a child; returns (exit status, stdout, stderr, the
    child's peak RSS in MiB)."""
    p = subprocess.Popen([sys.executable, "-m", "fastdeploy_sync.cli", "status", name,
                          "--timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    # communicate() reaped it: its peak RSS is the largest child's since, at most
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _good_status():
    return {"name": "x\x1b[2J\x1b]0;owned\x07", "dp_id": 0, "tp_size": 1,
            "endpoint": "ipc://here\n\rfake line", "engine": _FULL_ID, "pid": 1,
            "last_seq": 0, "retained": 0, "max_inflight": 1, "group": None,
            "ranks": [{"rank": 0, "state": "connected\x1b[31m", "consumed": 0,
                       "silent_s": 0.1, "worker": None, "reason": "\x1b[1mbold\x1b[0m"}]}


REPLIES = {
    "list": [json.dumps([]).encode()],
    "empty object": [json.dumps({}).encode()],
    "deep nesting": [b"[" * 200_000 + b"]" * 200_000],
    "wrong types": [json.dumps(dict(_good_status(), ranks="none")).encode()],
    "not json": [b"\xff\xfe{"],
    "many frames": [b"{}"] * 1000,
    "escapes": [json.dumps(_good_status()).encode()],
}


@pytest.fixture
def fake_engine(name):
    """A ROUTER at NAME's endpoint that answers every STATUS with ``reply`` (set by the
    test): the frames after the header."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = default_endpoint(name, 0)
    sock.bind(endpoint)
    os.chmod(ipc_path(endpoint), 0o600)
    state = {"reply": None, "stop": False}

    def serve():
        while not state["stop"]:
            if sock.poll(50):
                identity, *_ = sock.recv_multipart()
                sock.send_multipart([identity, codec.pack_header(codec.STATUS_REPLY),
                                     *state["reply"]])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield state
    state["stop"] = True
    thread.join(timeout=5)
    sock.close()
    ctx.term()
    os.unlink(ipc_path(endpoint))


@pytest.mark.parametrize("kind", list(REPLIES))
def test_status_against_a_hostile_endpoint_prints_one_safe_line(name, fake_engine, kind):
    """`[]`, `{}`, nesting 200 000 deep, wrong types, invalid UTF-8, 1000 frames: one line
    saying no engine answered, exit status 1, no traceback. A reply of the right shape
    whose strings carry escape sequences is printed with them escaped, and at most 8
    characters of the engine's instance. Before: tracebacks, raw escape sequences, the
    full instance id."""
    fake_engine["reply"] = REPLIES[kind]
    code, out, err = _status_cli(name)
    assert "Traceback" not in err, err
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert _FULL_ID not in out
    if kind == "escapes":
        assert code == 0, out + err
        assert "instance 5eed5eed)" in out and "\\x1b[2J" in out, out
        assert "\nfake line" not in out and "\\n\\rfake line" in out
    else:
        assert code == 1, out + err
        assert out.startswith("no engine answered: "), out
        assert "answered with" in out.splitlines()[0], out


def _zmtp_endless_server(path, stop, limit=None):
    """A raw ZMTP 3.0 peer (NULL security, a ROUTER) on unix socket ``path``: it greets, then
    answers the first thing it reads with an endless multipart message (4 KiB frames, each
    flagged MORE) until the client goes away, or, with ``limit``, until it sent that many
    bytes: then it hangs up, the message unfinished."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(1)
    srv.settimeout(10)

    def serve():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
            conn.sendall(greeting)
            name, value = b"Socket-Type", b"ROUTER"
            body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
            conn.sendall(bytes([0x04, len(body)]) + body)
            conn.settimeout(0.3)
            try:  # the client's greeting, READY and STATUS, until it goes quiet
                while conn.recv(4096):
                    pass
            except socket.timeout:
                pass
            conn.settimeout(10)
            frame = bytes([0x03]) + struct.pack(">Q", 4096) + bytes(4096)  # MORE | LONG
            blob = frame * 256
            sent = 0
            try:
                while not stop.is_set() and (limit is None or sent < limit):
                    conn.sendall(blob)
                    sent += len(blob)
            except OSError:
                pass  # the client gave up: what we want

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return srv, thread


# Starts argv (JSON in argv[1]) and reports its peak RSS with its children's (wait4) as the
# last line of stderr. A process forked from a large one (a pytest worker that grew) keeps
# that process's resident pages as its own peak across exec, so the measured command is
# started from this small launcher, never from the test's process.
_LAUNCHER = """
import json, os, sys
argv = json.loads(sys.argv[1])
pid = os.posix_spawn(argv[0], argv, os.environ)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nMAXRSS_KIB {usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _status_against_an_endless_reply(name, argv, limit=None):
    """Run ``argv`` (a ``fastdeploy-sync status NAME`` of some kind) against a peer that
    streams an endless reply at NAME's endpoint; returns (exit code, stdout, stderr, peak
    RSS in KiB of that process and the children it waited for)."""
    path = ipc_path(default_endpoint(name, 0))
    stop = threading.Event()
    srv, thread = _zmtp_endless_server(path, stop, limit)
    try:
        p = subprocess.Popen([sys.executable, "-c", _LAUNCHER, json.dumps(argv)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:  # the asker's own timeouts (at most 20 s) end it
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=10)
            raise AssertionError(f"{argv} did not end within 120 s") from None
    finally:
        stop.set()
        thread.join(timeout=15)
        srv.close()
        os.unlink(path)
    err, _, last = err.rstrip().rpartition("\n")
    assert last.startswith("MAXRSS_KIB "), last
    return p.returncode, out, err, int(last.split()[1])


def test_status_against_an_endless_reply_gives_up_within_bounded_memory(name):
    """A peer that answers with a message it never finishes: libzmq buffers it out of the
    client's sight. Before: 1.55 GiB within the 2 s timeout, then a timeout. Now: the
    asking child gives up (its memory watch, or its data segment's cap), one line, exit
    status 1."""
    code, out, err, peak_kib = _status_against_an_endless_reply(
        name, [sys.executable, "-m", "fastdeploy_sync.cli", "status", name, "--timeout", "5"])
    assert code == 1, out + err
    assert "Traceback" not in err, err
    assert "without finishing a reply" in out, out
    # the child that asks is capped at what it held plus 192 MiB
    assert peak_kib < 640 << 10, peak_kib


def test_status_endless_reply_is_bounded_even_when_the_memory_watch_never_looks(name):
    """The 2 ms memory watch is a schedule, not a bound: on a loaded machine the watching
    thread stays off the CPU while libzmq's I/O thread reads on. Here the watch is switched
    off, as a starved watcher is, so only the hard cap remains: the asking child's data
    segment limit (without the child the asker grows until its timeout)."""
    code, out, err, peak_kib = _status_against_an_endless_reply(
        name, [sys.executable, "-c", _BLIND_STATUS.format(name=name)])
    assert code == 1, out + err
    assert "Traceback" not in err, err
    assert "without finishing a reply" in out, out
    assert peak_kib < 640 << 10, peak_kib


def test_status_a_reply_abandoned_midway_is_named_even_when_the_memory_watch_never_looks(name):
    """A peer that streams 48 MiB of a reply and hangs up: libzmq drops the unfinished
    message and the ask times out, but this process's peak memory says what happened (as
    when the cap above makes libzmq drop the connection instead of aborting): one line that
    names the overrun, not "no TaskQueue answered". Before: the timeout's words."""
    code, out, err, peak_kib = _status_against_an_endless_reply(
        name, [sys.executable, "-c", _BLIND_STATUS.format(name=name)], limit=48 << 20)
    assert code == 1, out + err
    assert "Traceback" not in err, err
    assert "without finishing a reply" in out, out
    assert "the asking process ended" not in out, out  # the child answered: under its cap
    assert peak_kib < 640 << 10, peak_kib


# `fastdeploy-sync status NAME --timeout 20` whose 2 ms memory watch never sees growth (as a
# watcher kept off the CPU): only the asking child's cap and its peak memory remain. The
# timeout lets a loaded machine's peer stream past the cap (or its 48 MiB) first: with 3 s
# the ask timed out before, and said "no TaskQueue answered".
_BLIND_STATUS = ("import sys; from fastdeploy_sync import status_client; "
                 "status_client.anon_rss_bytes = lambda: 0; from fastdeploy_sync import cli; "
                 "sys.exit(cli.main(['status', {name!r}, '--timeout', '20']))")


def test_status_errors_of_the_asking_child_keep_their_kind_and_words(name):
    """The asking child passes on what it raised, by kind and with its words: an endpoint
    whose path is too long for a unix socket (libzmq: "File name too long") is one line
    that says so, not a peer's overrun. Before: "sent more than 192 MiB ... not a
    fastdeploy_sync engine"."""
    from fastdeploy_sync.envs import ipc_dir

    endpoint = "ipc://" + os.path.join(ipc_dir(), "x" * 200 + ".ipc")
    p = subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", name,
                        "--endpoint", endpoint, "--timeout", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "File name too long" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "sent more than" not in p.stdout + p.stderr


def test_status_interrupted_while_asking_exits_130_and_reaps_its_child(name):
    """Ctrl-C while the asking child waits for an endpoint that never answers: exit status
    130, no traceback, and the child is gone at once (not left to its own timeout). Before:
    a NameError traceback from the call's cleanup."""
    path = ipc_path(default_endpoint(name, 0))
    silent = socket.socket(socket.AF_UNIX)  # accepts, never speaks: the handshake hangs
    silent.bind(path)
    os.chmod(path, 0o600)
    silent.listen(4)
    try:
        # Ctrl-C's default disposition, as in a terminal: a test run started in the
        # background (nohup, '&' without job control) hands its children SIGINT ignored,
        # and Python then installs no KeyboardInterrupt handler
        p = subprocess.Popen([sys.executable, "-m", "fastdeploy_sync.cli", "status", name,
                              "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            asking = wait_until(lambda: children(p.pid), timeout=30, interval=0.05,
                                what="the CLI to fork its asking child",
                                seen=lambda: f"no child; the CLI's exit status {p.poll()}")
            silent.settimeout(30)
            conn, _ = silent.accept()
            with conn:  # the child has connected and spoken: it now waits for an answer
                conn.settimeout(30)
                assert conn.recv(1), "the asking child hung up without a word"
                p.send_signal(signal.SIGINT)
                out, err = p.communicate(timeout=15)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    finally:
        silent.close()
        os.unlink(path)
    assert p.returncode == 130, out + err
    assert "Traceback" not in err, err
    for child in asking:
        assert not os.path.exists(f"/proc/{child}"), f"asking child {child} outlived the CLI"


@needs_pid_namespace
def test_status_from_another_pid_namespace_sees_a_live_group_alive(name, procs, results):
    """`fastdeploy-sync status` in a sidecar container (its own pid namespace, the same
    /dev/shm) reads who is alive from the locks the owner and the ranks hold, not from
    their pids, which are nobody's there. Before: "exited: stale" and every rank False."""
    leave = SPAWN.Event()
    with TaskQueue(name, 2) as queue:
        try:
            for rank in range(2):
                procs(connected_rank, results, rank, name, 2, leave)
            collect(results, "ready", 2)
            out = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m",
                                  "fastdeploy_sync.cli", "status", name], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert "(alive)" in out.stdout and "exited" not in out.stdout, out.stdout
            rows = [line.split() for line in out.stdout.splitlines()
                    if line.strip()[:1].isdigit() and line.split()[1].isdigit()]
            assert [row[2] for row in rows] == ["True", "True"], out.stdout
        finally:
            leave.set()
        queue.close(timeout=5)
