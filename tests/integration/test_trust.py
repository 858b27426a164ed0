"""The trust boundary end to end, through TaskQueue and TaskClient with real processes and
sockets: CURVE over tcp, what strangers and misconfigured workers can (not) do to the
engine, a live rank's place, and running out of file descriptors.

(tests/integration/test_auth.py covers the key files and CURVE at the socket level,
tests/integration/test_private_paths.py the node-local directory and shared memory, tests/unit/test_codec.py
the decode path under corruption.)
"""

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import zmq
import zmq.auth

from fastdeploy_sync import AuthenticationError, Heartbeat, TaskClient, TaskQueue
from fastdeploy_sync.wire import codec
from fastdeploy_sync.wire.auth import CLIENT_SECRET, SERVER_PUBLIC, create_keys
from workers import (
    FAST_HEARTBEAT,
    collect,
    construct_and_exit,
    make_batch,
    step_until_error_rank,
    take_n_rank,
    wait_until,
)

HB = Heartbeat(*FAST_HEARTBEAT)


@pytest.fixture
def keys(tmp_path):
    """The engine's key directory, and worker key directories: a good one, one whose client
    key the engine never allowlisted, one that pins another engine's server key."""
    engine = create_keys(tmp_path / "engine")["dir"]
    other = create_keys(tmp_path / "other")["dir"]

    def mix(dirname, server_from, client_from):
        d = tmp_path / dirname
        d.mkdir(mode=0o700)
        shutil.copy(os.path.join(server_from, SERVER_PUBLIC), d / SERVER_PUBLIC)
        shutil.copy(os.path.join(client_from, CLIENT_SECRET), d / CLIENT_SECRET)
        os.chmod(d / CLIENT_SECRET, 0o600)
        return str(d)

    return dict(engine=engine, worker=engine, stranger=mix("stranger", engine, other),
                wrong_server=mix("wrong_server", other, engine))


def _tcp():
    return "tcp://127.0.0.1:0"


def _raw_dealer(ctx, endpoint, **options):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for key, value in options.items():
        setattr(sock, key, value)
    sock.connect(endpoint)
    return sock


def _recv_or_none(sock, timeout_ms):
    if sock.poll(timeout_ms):
        return sock.recv_multipart()
    return None


def test_tcp_without_keys_is_refused_with_a_how_to(name, monkeypatch):
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    monkeypatch.delenv("FD_SYNC_INSECURE_TCP", raising=False)
    with pytest.raises(AuthenticationError, match="fastdeploy-sync keys DIR"):
        TaskQueue(name, 1, endpoint=_tcp())
    with pytest.raises(AuthenticationError, match="FD_SYNC_INSECURE_TCP=1"):
        TaskClient(name, 1, 0, endpoint="tcp://127.0.0.1:9")


def test_insecure_opt_in_warns_naming_the_risk(name, caplog):
    with caplog.at_level(logging.WARNING, logger="fastdeploy_sync"):
        with TaskQueue(name, 1, endpoint=_tcp(), insecure_tcp=True):
            pass
    assert any("WITHOUT authentication" in r.getMessage() and "run code" in r.getMessage()
               for r in caplog.records)


def test_curve_stream_end_to_end_and_strangers_get_nothing(name, keys, procs, results,
                                                          monkeypatch):
    """With keys: two ranks take every batch; meanwhile an anonymous (non-CURVE) peer and a
    CURVE peer that pins the right server key but is not allowlisted both try HELLO as
    rank 1, and neither ever receives a byte of a message."""
    n = 30
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", keys["worker"])
    with TaskQueue(name, 2, endpoint=_tcp(), keys_dir=keys["engine"], heartbeat=HB) as queue:
        for rank in range(2):
            procs(take_n_rank, results, rank, name, 2, n, endpoint=queue.endpoint)
        ctx = zmq.Context()
        try:
            anonymous = _raw_dealer(ctx, queue.endpoint)
            stranger_public, stranger_secret = zmq.curve_keypair()
            stranger = _raw_dealer(ctx, queue.endpoint,
                                   curve_serverkey=zmq.auth.load_certificate(
                                       os.path.join(keys["engine"], SERVER_PUBLIC))[0],
                                   curve_publickey=stranger_public,
                                   curve_secretkey=stranger_secret)
            hello = [codec.pack_header(codec.HELLO, 1, 2, seq=1, group=1, worker=1),
                     name.encode()]
            for sock in (anonymous, stranger):
                sock.send_multipart(hello)
            for i in range(n):
                queue.put_tasks(make_batch(i), timeout=30)
            taken = collect(results, "taken", 2)
            for sock in (anonymous, stranger):
                assert _recv_or_none(sock, 300) is None
        finally:
            ctx.destroy(linger=0)
        stats = queue.stats()
    for rank in range(2):
        assert [b for b, _ in taken[rank]] == list(range(n))
    assert stats.get("hellos", 0) == 2  # only the real ranks' HELLOs reached the engine


@pytest.mark.parametrize("who", ["stranger", "wrong_server"])
def test_a_worker_with_the_wrong_keys_raises_and_never_unpickles(name, keys, procs, results,
                                                                monkeypatch, who):
    """A client key the engine did not allowlist, or a pinned server key that is not the
    engine's: the handshake fails, the worker raises AuthenticationError and has received
    nothing."""
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", keys[who])
    with TaskQueue(name, 1, endpoint=_tcp(), keys_dir=keys["engine"], heartbeat=HB) as queue:
        queue.put_tasks("a prompt", timeout=5)
        procs(step_until_error_rank, results, 0, name, 1, True, queue.endpoint)
        # the rank's own bound (60 s) reports a hang; this one only outlasts it, so that
        # a slow start on a loaded machine is not taken for one
        raised = collect(results, "raised", 1, timeout=90)[0]
        assert raised["cause"] == "AuthenticationError", raised
        assert raised["taken"] == []
        if who == "stranger":
            assert "refused this worker's public key" in raised["message"]
        else:
            assert "hung up on this worker's CURVE handshake, which pins" in raised["message"]
        assert queue.stats()["consumed"] == [0]


def test_a_storm_of_bad_hellos_and_a_misconfigured_worker_do_not_stop_the_engine(
        name, procs, results, caplog):
    """Rejected HELLOs from peers that disconnect at once (the reply then fails with
    EHOSTUNREACH), a worker with the wrong tp_size that exits at once, an oversized
    message: the engine keeps serving, every batch reaches every rank once, in order, and
    the log says so a bounded number of times."""
    n = 40
    with caplog.at_level(logging.WARNING, logger="fastdeploy_sync"):
        with TaskQueue(name, 2, heartbeat=HB) as queue:
            for rank in range(2):
                procs(take_n_rank, results, rank, name, 2, n)
            ctx = zmq.Context()
            try:
                for i in range(n):
                    queue.put_tasks(make_batch(i), timeout=30)
                    if i % 4 == 0:
                        for variant in range(5):
                            vandal = _raw_dealer(ctx, queue.endpoint)
                            tp, who = (0, name) if variant == 0 else (2, "x" * 10)
                            vandal.send_multipart([codec.pack_header(
                                codec.HELLO, variant % 2, tp, seq=1, group=variant + 1,
                                worker=variant + 1), who.encode()])
                            vandal.close(linger=100)  # gone before the engine can answer
                    if i == 8:  # a worker built with the wrong tp_size, gone at once
                        procs(construct_and_exit, results, name)
                    if i == 16:
                        big = _raw_dealer(ctx, queue.endpoint)
                        big.send(os.urandom(1 << 20))  # above the engine's MAXMSGSIZE
                        big.close(linger=500)
                taken = collect(results, "taken", 2)
            finally:
                ctx.destroy(linger=0)
            stats = queue.stats()
    for rank in range(2):
        assert [b for b, _ in taken[rank]] == list(range(n))
    assert stats["rejected"] >= 20
    rejected_lines = [r for r in caplog.records if "rejected a worker" in r.getMessage()]
    assert len(rejected_lines) < stats["rejected"]  # rate-limited per peer


def test_a_live_ranks_place_cannot_be_taken(name, procs, results):
    """A second process claiming rank 1 of the live group (same group incarnation, its own
    worker id) is refused and receives no batch; the real ranks go on undisturbed."""
    n = 20
    with TaskQueue(name, 2, heartbeat=HB) as queue:
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2, True, report_after=n)
        ready = collect(results, "ready", 2)
        incarnation = ready[1][2]
        # a rank is "ready" once built; its HELLO may still be on its way (the prefetch
        # thread sends it): a claim made before that would be the first, and win the place
        assert wait_until(lambda: [r["state"] for r in queue.ranks()] == ["connected"] * 2, 30)
        ctx = zmq.Context()
        try:
            impostor = _raw_dealer(ctx, queue.endpoint)
            impostor.send_multipart([codec.pack_header(codec.HELLO, 1, 2, seq=1, group=incarnation,
                                                       worker=12345), name.encode()])
            for i in range(n):
                try:
                    queue.put_tasks(i, timeout=30)
                except TimeoutError as exc:  # say what the ranks said
                    said = []
                    while not results.empty():
                        said.append(results.get(timeout=1))
                    raise AssertionError(f"{exc}; the ranks reported {said}") from exc
            reply = _recv_or_none(impostor, 5000)
            assert reply is not None
            header = codec.unpack_header(reply[0])
            assert header.kind == codec.ERROR and header.aux == codec.E_PLACE_TAKEN
            assert b"held by a live worker" in reply[1]
            assert _recv_or_none(impostor, 300) is None  # and nothing after that
        finally:
            ctx.destroy(linger=0)
        took = collect(results, "took_n", 2, timeout=30)
        assert took[0] == took[1] == list(range(n))
        assert [r["state"] for r in queue.ranks()] == ["connected"] * 2


def test_running_out_of_file_descriptors_raises_and_the_process_lives_on(name):
    code = textwrap.dedent(f"""
        import errno, resource
        import fastdeploy_sync as fs
        # soft and hard: a TaskQueue raises its soft limit to the hard one at start
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
        hold = [open("/dev/null") for _ in range(20)]
        for make in (lambda: fs.TaskClient({name!r}, 1, 0), lambda: fs.TaskQueue({name!r}, 1)):
            try:
                make()
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                assert "ulimit -n" in str(exc), exc
            else:
                raise SystemExit("no OSError")
        for f in hold:
            f.close()
        with fs.TaskQueue({name!r}, 1) as q:  # usable again once fds are free
            q.put_tasks("ok", timeout=1)
        print("alive")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"


def test_a_key_holder_cannot_take_a_live_ranks_place(name, keys, procs, results, monkeypatch):
    """A process holding the worker key asks the engine's status and claims rank 1 with
    whatever ids it shows. Worker ids are secrets (status shows a short tag), so the claim
    is refused (E_PLACE_TAKEN), the intruder receives no batch, the real ranks take every
    batch, and once the intruder has left the group goes on (it stayed stuck for good when
    a claim with a disclosed id took the rank over)."""
    from engine_peers import intruder_process

    n = 20
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", keys["worker"])
    with TaskQueue(name, 2, endpoint=_tcp(), keys_dir=keys["engine"], heartbeat=HB) as queue:
        for rank in range(2):
            procs(step_until_error_rank, results, rank, name, 2, True, queue.endpoint,
                  report_after=2 * n)
        ready = collect(results, "ready", 2)
        for i in range(n // 2):
            queue.put_tasks(i, timeout=30)
        assert wait_until(lambda: queue.num_tasks() == 0, timeout=30)
        procs(intruder_process, results, 1, queue.endpoint, name, 2, keys["worker"], 1.0)
        for i in range(n // 2, n):
            queue.put_tasks(i, timeout=30)
            time.sleep(0.05)
        intruded = collect(results, "intruded", 1, timeout=60)[1]
        # the intruder has left: the group is not stuck
        for i in range(n, 2 * n):
            queue.put_tasks(i, timeout=30)
        took = collect(results, "took_n", 2, timeout=60)
        assert took[0] == took[1] == list(range(2 * n))
        assert [r["state"] for r in queue.ranks()] == ["connected"] * 2
        assert queue.group_events.empty()
    assert not intruded["welcomed"] and intruded["data"] == 0, intruded
    assert set(intruded["errors"]) <= {codec.E_PLACE_TAKEN, codec.E_GROUP_BUSY}, intruded
    status = intruded["status"].decode()
    for rank in range(2):
        pid, worker, incarnation = ready[rank]
        assert f"{worker:016x}" not in status and f"{worker:x}" not in status
        assert f"{incarnation:016x}" not in status and f"{incarnation:x}" not in status
    collect(results, "raised", 2, timeout=30)  # EngineClosedError at close


def test_a_key_removed_from_the_allowlist_is_refused_within_seconds(name, keys, tmp_path):
    """Revoking a worker key is deleting its file from allowed_clients/: new connections
    with it are refused within seconds, without restarting the engine (and a key copied in
    is admitted the same way). Connections are new ones each time (query_status)."""
    from fastdeploy_sync.engine.queue import query_status
    from fastdeploy_sync.wire.auth import ALLOWLIST_DIR, CLIENT_PUBLIC

    extra = create_keys(tmp_path / "extra")["dir"]
    worker_dir = tmp_path / "extra-worker"
    worker_dir.mkdir(mode=0o700)
    shutil.copy(os.path.join(keys["engine"], SERVER_PUBLIC), worker_dir / SERVER_PUBLIC)
    shutil.copy(os.path.join(extra, CLIENT_SECRET), worker_dir / CLIENT_SECRET)
    os.chmod(worker_dir / CLIENT_SECRET, 0o600)
    admitted = os.path.join(keys["engine"], ALLOWLIST_DIR, "extra.key")

    def answered():
        try:
            query_status(endpoint, keys_dir=str(worker_dir), timeout=0.5)
        except TimeoutError:
            return False
        return True

    with TaskQueue(name, 1, endpoint=_tcp(), keys_dir=keys["engine"], heartbeat=HB) as queue:
        endpoint = queue.endpoint
        assert not answered()  # not on the allowlist
        shutil.copy(os.path.join(extra, CLIENT_PUBLIC), admitted)
        start = time.monotonic()
        assert wait_until(answered, timeout=15), "a key copied into the allowlist was not admitted"
        print(f"admitted after {time.monotonic() - start:.2f} s")
        os.unlink(admitted)
        start = time.monotonic()
        assert wait_until(lambda: not answered(), timeout=15), \
            "a key removed from the allowlist was still admitted"
        print(f"refused after {time.monotonic() - start:.2f} s")
        for _ in range(3):
            assert not answered()
        query_status(endpoint, keys_dir=keys["worker"], timeout=5)  # the others still work
