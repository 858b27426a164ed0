"""CURVE on tcp endpoints, with real sockets on 127.0.0.1: the engine side is a raw ROUTER with
ServerAuth in this process, peers are DEALERs in child processes. Every receive has a timeout."""

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from fastdeploy_sync import TaskQueue
from fastdeploy_sync.errors import AuthenticationError
from fastdeploy_sync.wire.auth import ClientAuth, ServerAuth, create_keys, handshake_failure_message

RECV_MS = 3000
# Bounds on a hang, not performance claims: a peer process started on a loaded machine may
# take many seconds to import, connect and handshake, and a reply as long to arrive.
HELLO_WAIT_MS = 60_000
REPLY_WAIT_S = 60.0
RESULT_WAIT_S = 120.0
HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}


def _keys_cli(directory, *extra):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "keys", str(directory),
                           *extra], capture_output=True, text=True, timeout=60)


@pytest.fixture
def keys(tmp_path):
    """A key directory made by the command line, as a user would make it."""
    d = tmp_path / "keys"
    done = _keys_cli(d)
    assert done.returncode == 0, done.stderr
    return str(d)


@pytest.fixture
def server(keys, monkeypatch):
    """A CURVE ROUTER on 127.0.0.1 (ROUTER_MANDATORY, as the engine's) and its endpoint."""
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    ctx = zmq.Context()
    auth = ServerAuth.start(ctx, "tcp://127.0.0.1:0", keys_dir=keys)
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.router_mandatory = 1
    auth.apply(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    auth.close()
    ctx.term()


def _events(mon, until, stop_on=()):
    out = []
    while time.monotonic() < until:
        if mon.poll(50):
            ev = recv_monitor_message(mon)
            out.append((ev["event"], ev["value"]))
            if ev["event"] in stop_on:
                break
    return out


def peer(endpoint, keys, mode, results, identity=b"r0", listen_s=2.0):
    """A DEALER that connects, says hello and listens; reports what it saw.

    mode: "good" (our keys), "anonymous" (no CURVE), "stranger" (a valid key pair that is not
    allowlisted, right server key pinned), "wrong_pin" (pins another server's key).
    "good" listens until it has the reply and the handshake's event, the others until
    ``listen_s`` after their handshake failed (what they must not receive); each at most
    ``REPLY_WAIT_S``. Not a fixed window from the send: it could close before a
    descheduled engine answered."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    if mode == "good":
        ClientAuth.load(endpoint, keys_dir=keys).apply(sock)
    elif mode in ("stranger", "wrong_pin"):
        other = os.path.join(os.path.dirname(keys), "other")
        create_keys(other)
        auth = ClientAuth.load(endpoint, keys_dir=other)
        if mode == "stranger":
            auth.server_key = ClientAuth.load(endpoint, keys_dir=keys).server_key
        auth.apply(sock)
    mon = sock.get_monitor_socket()
    sock.connect(endpoint)
    sock.send(b"hello from " + identity)
    received = []
    events = []
    until = time.monotonic() + REPLY_WAIT_S
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    while time.monotonic() < until:
        for s, _ in poller.poll(50):
            if s is sock:
                received.append(sock.recv(zmq.NOBLOCK))
            else:
                ev = recv_monitor_message(mon)
                events.append((ev["event"], ev["value"]))
                if ev["event"] in HANDSHAKE_FAILED:
                    until = min(until, time.monotonic() + listen_s)
        # done once it has the reply and the monitor told of the handshake (its event can
        # be read after the reply: it comes through another socket)
        if mode == "good" and received and (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) in events:
            break
    results.put((mode, received, events))
    sock.disable_monitor()
    mon.close(0)
    sock.close(0)
    ctx.term()


def _recv(sock, ms=RECV_MS):
    if not sock.poll(ms):
        return None
    return sock.recv_multipart(zmq.NOBLOCK)


def _result(results):
    return results.get(timeout=RESULT_WAIT_S)


def test_stream_works_with_keys(server, keys, procs, results):
    sock, endpoint = server
    procs(peer, endpoint, keys, "good", results)
    got = _recv(sock, HELLO_WAIT_MS)
    assert got == [b"r0", b"hello from r0"]
    sock.send_multipart([b"r0", b"batch 1"])
    mode, received, events = _result(results)
    assert received == [b"batch 1"]
    assert (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) in events


def test_anonymous_peer_never_completes_a_handshake(server, keys, procs, results):
    sock, endpoint = server
    procs(peer, endpoint, keys, "anonymous", results, identity=b"anon")
    assert _recv(sock) is None
    # it never became a routable peer: the engine cannot even address a message to it
    with pytest.raises(zmq.ZMQError) as exc:
        sock.send_multipart([b"anon", b"a user's prompt"])
    assert exc.value.errno == zmq.EHOSTUNREACH
    mode, received, events = _result(results)
    assert received == []
    kinds = {e for e, _ in events}
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in kinds
    # measured with libzmq 4.3.5: NO_DETAIL (EPIPE), sometimes PROTOCOL (mechanism mismatch)
    assert kinds & {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}, events


def test_raw_tcp_peer_gets_only_the_greeting(server):
    """Below ZeroMQ: a plain TCP client that speaks NULL gets at most the 64-byte ZMTP
    greeting and the connection is closed; never a byte of a message."""
    sock, endpoint = server
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    # ZMTP 3.0 greeting: signature, version 3.0, mechanism "NULL", as-server 0, filler
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    ready = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
    raw = socket.create_connection((host, int(port)), timeout=5)
    got = b""
    hung_up = False
    try:
        raw.sendall(greeting + ready)
        raw.settimeout(3)
        while True:
            try:
                chunk = raw.recv(4096)
            except socket.timeout:
                break
            except ConnectionResetError:  # closed with our READY unread: may drop the rest
                hung_up = True
                break
            if not chunk:
                hung_up = True
                break
            got += chunk
    finally:
        raw.close()
    assert hung_up, got
    # libzmq 4.3.5 sends its 10-byte signature (or nothing, when the reset overtakes it),
    # reads our greeting (NULL), and hangs up before the rest of its greeting
    assert got == b"\xff\0\0\0\0\0\0\0\x01\x7f"[:len(got)] or (
        len(got) <= 64 and got[12:17] == b"CURVE"), got  # never a message frame
    assert _recv(sock, 200) is None


def test_key_not_in_allowlist_is_refused(server, keys, procs, results):
    sock, endpoint = server
    procs(peer, endpoint, keys, "stranger", results, identity=b"stranger")
    assert _recv(sock) is None
    mode, received, events = _result(results)
    assert received == []
    # measured with libzmq 4.3.5: the ZAP refusal reaches the client as AUTH, status 400
    auth = [v for e, v in events if e == zmq.EVENT_HANDSHAKE_FAILED_AUTH]
    assert auth == [400], events
    msg = handshake_failure_message(zmq.EVENT_HANDSHAKE_FAILED_AUTH, endpoint, 400, keys)
    assert "refused this worker's public key" in msg and "allowed_clients/" in msg


def test_client_pinning_another_engine_key_gets_nothing(server, keys, procs, results):
    """The impostor case: whoever holds the port is not the engine the worker pinned."""
    sock, endpoint = server
    procs(peer, endpoint, keys, "wrong_pin", results, identity=b"w0")
    assert _recv(sock) is None
    with pytest.raises(zmq.ZMQError) as exc:
        sock.send_multipart([b"w0", b"pickle that runs code"])
    assert exc.value.errno == zmq.EHOSTUNREACH
    mode, received, events = _result(results)
    assert received == []
    kinds = [e for e, _ in events]
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in kinds
    # measured with libzmq 4.3.5: NO_DETAIL (value EPIPE) on every reconnect
    assert zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL in kinds, events
    msg = handshake_failure_message(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, endpoint, None, keys)
    assert f"the peer at {endpoint} hung up on this worker's CURVE handshake" in msg
    assert os.path.join(keys, "server.key") in msg and "another process holds the port" in msg


def test_mechanism_mismatch_message(keys):
    msg = handshake_failure_message(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "tcp://h:1",
                                    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, keys)
    assert "this worker uses CURVE keys" in msg and "does not" in msg


@pytest.mark.parametrize("side", ["server", "client"])
def test_missing_keys_raise_with_the_howto(side, monkeypatch):
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    monkeypatch.delenv("FD_SYNC_INSECURE_TCP", raising=False)
    ctx = zmq.Context()
    try:
        with pytest.raises(AuthenticationError) as exc:
            if side == "server":
                ServerAuth.start(ctx, "tcp://0.0.0.0:5555")
            else:
                ClientAuth.load("tcp://10.0.0.1:5555")
    finally:
        ctx.term()
    text = str(exc.value)
    assert "fastdeploy-sync keys DIR" in text and "FD_SYNC_KEYS_DIR=DIR" in text
    assert "tcp://" in text and "FD_SYNC_INSECURE_TCP=1" in text


def test_ipc_needs_no_keys(monkeypatch):
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    ctx = zmq.Context()
    try:
        assert ServerAuth.start(ctx, "ipc:///x/y.ipc") is None
    finally:
        ctx.term()
    assert ClientAuth.load("ipc:///x/y.ipc") is None


@pytest.mark.parametrize("how", ["env", "argument"])
def test_insecure_opt_in_warns(how, monkeypatch, caplog):
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    kwargs = {}
    if how == "env":
        monkeypatch.setenv("FD_SYNC_INSECURE_TCP", "1")
    else:
        kwargs["insecure"] = True
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="fastdeploy_sync.wire.auth"):
            assert ServerAuth.start(ctx, "tcp://127.0.0.1:5555", **kwargs) is None
            assert ClientAuth.load("tcp://127.0.0.1:5555", **kwargs) is None
    finally:
        ctx.term()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    for r in warnings:
        assert "read users' prompts and run code in the workers" in r.getMessage()


def test_keys_from_env(keys, monkeypatch):
    monkeypatch.setenv("FD_SYNC_KEYS_DIR", keys)
    auth = ClientAuth.load("tcp://127.0.0.1:1")
    assert auth.keys_dir == keys


def test_keys_command_layout_modes_and_no_overwrite(tmp_path):
    d = tmp_path / "k"
    done = _keys_cli(d)
    assert done.returncode == 0, done.stderr
    mode = lambda p: stat.S_IMODE(os.stat(d / p).st_mode)  # noqa: E731
    assert mode(".") == 0o700
    assert mode("server.key_secret") == 0o600 and mode("client.key_secret") == 0o600
    assert mode("allowed_clients") == 0o700
    assert (d / "allowed_clients" / "client.key").read_bytes() == (d / "client.key").read_bytes()
    assert sorted(os.listdir(d)) == ["allowed_clients", "client.key", "client.key_secret",
                                     "server.key", "server.key_secret"]
    before = (d / "server.key_secret").read_bytes()
    again = _keys_cli(d)
    assert again.returncode == 1 and "--force" in again.stderr
    assert (d / "server.key_secret").read_bytes() == before
    forced = _keys_cli(d, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (d / "server.key_secret").read_bytes() != before
    assert mode("server.key_secret") == 0o600


def test_secret_readable_by_others_is_refused(keys):
    secret = os.path.join(keys, "client.key_secret")
    os.chmod(secret, 0o640)
    with pytest.raises(AuthenticationError, match=rf"{secret} has mode 0o640.*chmod 600"):
        ClientAuth.load("tcp://127.0.0.1:1", keys_dir=keys)
    ctx = zmq.Context()
    try:
        os.chmod(os.path.join(keys, "server.key_secret"), 0o604)
        with pytest.raises(AuthenticationError, match="server.key_secret has mode 0o604"):
            ServerAuth.start(ctx, "tcp://127.0.0.1:1", keys_dir=keys)
    finally:
        ctx.term()


def test_unreadable_or_corrupt_keys_name_the_file(keys):
    os.unlink(os.path.join(keys, "server.key"))
    with pytest.raises(AuthenticationError, match=r"server\.key \(No such file"):
        ClientAuth.load("tcp://127.0.0.1:1", keys_dir=keys)
    with open(os.path.join(keys, "server.key"), "w") as f:
        f.write("not a certificate\n")
    with pytest.raises(AuthenticationError, match=r"server\.key"):
        ClientAuth.load("tcp://127.0.0.1:1", keys_dir=keys)
    for name in os.listdir(os.path.join(keys, "allowed_clients")):
        os.unlink(os.path.join(keys, "allowed_clients", name))
    ctx = zmq.Context()
    try:
        with pytest.raises(AuthenticationError, match="allowed_clients holds no public key"):
            ServerAuth.start(ctx, "tcp://127.0.0.1:1", keys_dir=keys)
    finally:
        ctx.term()


# -- what each authentication failure tells the worker (a real engine) ---------------------
#
# Three of the four failures are reported once by libzmq (measured: ZAP refusal, and the
# mechanism mismatch in both directions; a wrongly pinned key repeats on every reconnect),
# so these tests watch a worker-side socket set up exactly as TaskClient sets up its data
# socket (ClientAuth.apply, or nothing without keys), with its monitor attached before it
# connects, and build the message as TaskClient does: handshake_failure_message(event,
# endpoint, value, keys of the ClientAuth or None).

def _first_handshake_failure(endpoint, keys, insecure=False, within_s=20.0):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        auth = ClientAuth.load(endpoint, keys_dir=keys, insecure=insecure)
        if auth is not None:
            auth.apply(sock)
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(endpoint)
        try:
            if not mon.poll(within_s * 1000):
                raise AssertionError(f"no handshake event within {within_s} s")
            ev = recv_monitor_message(mon)
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)
        assert ev["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "the handshake succeeded"
        return handshake_failure_message(ev["event"], endpoint, ev["value"],
                                         auth.keys_dir if auth else None)
    finally:
        ctx.term()


@pytest.fixture
def key_sets(tmp_path, monkeypatch):
    """The engine's keys, a worker key pair the engine never admitted (with the engine's
    server.key), and a wholly other key set."""
    monkeypatch.delenv("FD_SYNC_KEYS_DIR", raising=False)
    engine = str(tmp_path / "engine")
    stranger = str(tmp_path / "stranger")
    other = str(tmp_path / "other")
    for d in (engine, stranger, other):
        assert _keys_cli(d).returncode == 0
    shutil.copy(os.path.join(engine, "server.key"), os.path.join(stranger, "server.key"))
    return engine, stranger, other


def test_insecure_worker_against_keyed_engine_is_not_told_about_a_pinned_key(key_sets):
    engine, _, _ = key_sets
    with TaskQueue("authmsg", 1, endpoint="tcp://127.0.0.1:0", keys_dir=engine) as queue:
        msg = _first_handshake_failure(queue.endpoint, None, insecure=True)
    assert "pinned" not in msg and "pins" not in msg
    assert "this worker runs without keys" in msg and queue.endpoint in msg
    assert "requires CURVE keys" in msg
    assert "server.key, client.key and client.key_secret" in msg and "FD_SYNC_KEYS_DIR" in msg


def test_worker_key_not_allowlisted_names_the_public_key_file(key_sets):
    engine, stranger, _ = key_sets
    with TaskQueue("authmsg", 1, endpoint="tcp://127.0.0.1:0", keys_dir=engine) as queue:
        msg = _first_handshake_failure(queue.endpoint, stranger)
    public = zmq.auth.load_certificate(os.path.join(stranger, "client.key"))[0].decode()
    assert f"refused this worker's public key {public}" in msg
    assert f"Copy {os.path.join(stranger, 'client.key')} into the engine's allowed_clients/" in msg
    assert "restart the engine" in msg and "pinned" not in msg


def test_worker_without_client_key_is_told_how_to_derive_it(key_sets):
    """README's old key-distribution line left no client.key on worker nodes."""
    engine, stranger, _ = key_sets
    os.unlink(os.path.join(stranger, "client.key"))
    with TaskQueue("authmsg", 1, endpoint="tcp://127.0.0.1:0", keys_dir=engine) as queue:
        msg = _first_handshake_failure(queue.endpoint, stranger)
    secret = os.path.join(stranger, "client.key_secret")
    derive = f"grep -v secret-key {secret} > {os.path.join(stranger, 'client.key')}"
    assert derive in msg
    # the command it gives makes a public key file the engine's allowlist accepts
    subprocess.run(derive, shell=True, check=True, timeout=10)
    allowed = zmq.auth.load_certificates(os.path.join(engine, "allowed_clients"))
    shutil.copy(os.path.join(stranger, "client.key"),
                os.path.join(engine, "allowed_clients", "stranger.key"))
    admitted = zmq.auth.load_certificates(os.path.join(engine, "allowed_clients"))
    assert set(admitted) - set(allowed) == {zmq.auth.load_certificate(secret)[0]}


def test_keyed_worker_against_engine_without_keys(key_sets):
    engine, _, _ = key_sets
    with TaskQueue("authmsg", 1, endpoint="tcp://127.0.0.1:0", insecure_tcp=True) as queue:
        msg = _first_handshake_failure(queue.endpoint, engine)
    # libzmq reports a mechanism mismatch (or only the hang-up): both name the engine's side
    assert "runs without keys (FD_SYNC_INSECURE_TCP=1)" in msg, msg
    assert "FD_SYNC_KEYS_DIR" in msg and os.path.join(engine, "server.key") in msg


def auth_worker(endpoint, keys, results):
    """A TaskClient (sync mode: the failing call raises the error itself) with ``keys``;
    reports the first TaskSyncError's type and message."""
    from fastdeploy_sync import TaskClient, TaskSyncError

    try:
        with TaskClient("authmsg", 1, 0, endpoint=endpoint, async_prefetch=False,
                        keys_dir=keys) as client:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    client.sync_step(timeout=2)
                except TaskSyncError as exc:
                    results.put((type(exc).__name__, str(exc)))
                    return
            results.put(("nothing raised", ""))
    except BaseException as exc:  # noqa: BLE001 -- reported to the test, not lost
        results.put((f"constructor {type(exc).__name__}", str(exc)))


def test_worker_pinning_another_engine_key_is_told_which_file(key_sets, procs, results):
    """End to end, with a TaskClient process: this failure repeats on every reconnect."""
    engine, _, other = key_sets
    with TaskQueue("authmsg", 1, endpoint="tcp://127.0.0.1:0", keys_dir=engine) as queue:
        procs(auth_worker, queue.endpoint, other, results)
        kind, msg = results.get(timeout=40)
    assert kind == "AuthenticationError", (kind, msg)
    pinned = zmq.auth.load_certificate(os.path.join(other, "server.key"))[0].decode()
    assert f"pins the engine key {pinned} from {os.path.join(other, 'server.key')}" in msg
    assert "copy the engine's current server.key" in msg


@pytest.mark.parametrize("missing, side, says", [
    ("server.key", "worker", "the engine's public key, which a worker pins"),
    ("client.key_secret", "worker", "the worker's own key pair"),
    ("server.key_secret", "engine", "the engine's key pair"),
])
def test_missing_key_file_says_what_it_is_and_where_it_comes_from(keys, missing, side, says):
    path = os.path.join(keys, missing)
    os.unlink(path)
    ctx = zmq.Context()
    try:
        with pytest.raises(AuthenticationError) as exc:
            if side == "worker":
                ClientAuth.load("tcp://127.0.0.1:1", keys_dir=keys)
            else:
                ServerAuth.start(ctx, "tcp://127.0.0.1:1", keys_dir=keys)
    finally:
        ctx.term()
    text = str(exc.value)
    assert f"{path} (No such file or directory)" in text and says in text
    assert "fastdeploy-sync keys" in text


def test_keys_command_says_to_copy_client_key(tmp_path):
    done = _keys_cli(tmp_path / "k")
    assert done.returncode == 0, done.stderr
    line = [ln for ln in done.stdout.splitlines() if "worker nodes" in ln][0]
    for name in ("server.key,", "client.key and", "client.key_secret"):
        assert name in line, line
