"""CURVE keys and authentication for ``tcp://`` endpoints (ZeroMQ CURVE + ZAP via pyzmq).

Why: the channel carries users' prompts, and workers unpickle what they receive. Over tcp
anyone who reaches the port could say HELLO as a rank and read the prompts, or bind the
port first and run code in the workers. With CURVE the engine accepts only clients whose
public key is in its allowlist, and every worker pins the engine's public key, so neither
side talks to an impostor and the traffic is encrypted. All cryptography is libsodium's,
through libzmq (``zmq.has("curve")``); this module only manages key files.

``ipc://`` endpoints need no keys: they are protected by the private 0700 directory and
0600 socket file (``wire.endpoints``).

Key directory, made by ``fastdeploy-sync keys DIR`` (``create_keys``)::

    DIR/                      mode 0700
      server.key              engine's public key     -> every worker node
      server.key_secret       engine's secret key     -> engine node only (0600)
      client.key              workers' public key
      client.key_secret       workers' secret key     -> every worker node (0600)
      allowed_clients/        the engine's allowlist  -> engine node only
        client.key            (one public key per allowed client; add more to admit them)

The engine reads ``server.key_secret`` and ``allowed_clients/``; a worker reads
``server.key`` and ``client.key_secret``. To run workers on other nodes, copy ``server.key``,
``client.key`` and ``client.key_secret`` (keeping mode 0600) into a directory there and
point ``FD_SYNC_KEYS_DIR`` at it (``client.key`` is not read by the worker: it is the file
to put into an engine's ``allowed_clients/``, and the one an authentication error names).
Secret files must not be accessible by group or other.

Use: ``ServerAuth.start(ctx, endpoint)`` before binding the engine's socket and
``auth.apply(sock)``; ``ClientAuth.load(endpoint)`` and ``auth.apply(sock)`` before a worker
connects. Both return None when no CURVE is needed (ipc, or tcp with the insecure opt-in).
"""

import errno
import logging
import os
import shutil
import stat
import tempfile
import time
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .. import envs
from ..errors import AuthenticationError

__all__ = [
    "SERVER_PUBLIC",
    "SERVER_SECRET",
    "CLIENT_PUBLIC",
    "CLIENT_SECRET",
    "ALLOWLIST_DIR",
    "ZAP_DOMAIN",
    "create_keys",
    "keys_dir",
    "needs_auth",
    "ServerAuth",
    "ClientAuth",
    "handshake_failure_message",
    "missing_key_message",
    "HANDSHAKE_FAILED_EVENTS",
]

log = logging.getLogger(__name__)

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
ALLOWLIST_DIR = "allowed_clients"
ZAP_DOMAIN = "fastdeploy_sync"

HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_HOWTO = ("create keys with 'fastdeploy-sync keys DIR' and set FD_SYNC_KEYS_DIR=DIR for the "
          "engine and the workers (workers on other nodes need DIR/server.key, DIR/client.key "
          "and DIR/client.key_secret)")
_RISK = ("anyone who can reach the port can read users' prompts and run code in the workers")


def keys_dir(explicit=None):
    """The key directory: ``explicit`` if given, else ``FD_SYNC_KEYS_DIR``, else None."""
    if explicit is not None:
        return os.fspath(explicit)
    return envs.keys_dir()


def needs_auth(endpoint: str) -> bool:
    """True for endpoints that leave the node's private filesystem (tcp and anything else
    network-facing); False for ``ipc://`` and ``inproc://``."""
    return not endpoint.startswith(("ipc://", "inproc://"))


def create_keys(directory, force: bool = False) -> dict:
    """Create a server and a client key pair and the allowlist in ``directory``.

    Creates ``directory`` (mode 0700) if needed; an existing one must be ours (else
    ``PermissionError``) and is narrowed to 0700. ``FileExistsError`` if any key file exists,
    unless ``force=True`` (then every file of the layout is replaced). Secret files are
    0600. Keys are written into a 0700 staging directory inside ``directory`` and renamed
    into place, so no other user can read a secret at any moment. Returns the paths:
    ``{"dir", "server_public", "server_secret", "client_public", "client_secret",
    "allowlist"}``.
    """
    directory = os.path.abspath(os.fspath(directory))
    try:
        os.makedirs(directory, mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(
            errno.EPERM, f"{directory} is not a directory owned by uid {os.geteuid()} "
            f"(owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}): choose a "
            f"directory of your own for keys", directory)
    os.chmod(directory, 0o700)
    paths = {
        "dir": directory,
        "server_public": os.path.join(directory, SERVER_PUBLIC),
        "server_secret": os.path.join(directory, SERVER_SECRET),
        "client_public": os.path.join(directory, CLIENT_PUBLIC),
        "client_secret": os.path.join(directory, CLIENT_SECRET),
        "allowlist": os.path.join(directory, ALLOWLIST_DIR),
    }
    allowed_client = os.path.join(paths["allowlist"], CLIENT_PUBLIC)
    existing = [p for p in (paths["server_public"], paths["server_secret"],
                            paths["client_public"], paths["client_secret"], allowed_client)
                if os.path.lexists(p)]
    if existing and not force:
        raise FileExistsError(
            errno.EEXIST, f"keys exist already ({', '.join(existing)}): keep them, or pass "
            f"--force to replace them (every engine and worker then needs the new files)",
            existing[0])
    staging = tempfile.mkdtemp(prefix=".staging-", dir=directory)  # mode 0700
    try:
        zmq.auth.create_certificates(staging, "server")
        zmq.auth.create_certificates(staging, "client")
        # pyzmq writes with the process umask (often 0644): narrow before anything moves out.
        for name in (SERVER_SECRET, CLIENT_SECRET):
            os.chmod(os.path.join(staging, name), 0o600)
        for name in (SERVER_PUBLIC, CLIENT_PUBLIC):
            os.chmod(os.path.join(staging, name), 0o644)
        os.makedirs(paths["allowlist"], mode=0o700, exist_ok=True)
        os.chmod(paths["allowlist"], 0o700)
        shutil.copyfile(os.path.join(staging, CLIENT_PUBLIC), os.path.join(staging, "allowed"))
        os.replace(os.path.join(staging, "allowed"), allowed_client)
        for name in (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET):
            os.replace(os.path.join(staging, name), os.path.join(directory, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def _load(path: str, secret: bool):
    """(public, secret-or-None) from a key file, or AuthenticationError naming the file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise AuthenticationError(missing_key_message(path, exc.strerror or str(exc))) from None
    if secret:
        if st.st_uid != os.geteuid():
            raise AuthenticationError(
                f"secret key file {path} is owned by uid {st.st_uid}, not by this process's uid "
                f"{os.geteuid()}: copy it and chown it to the user running fastdeploy_sync")
        if st.st_mode & 0o077:
            raise AuthenticationError(
                f"secret key file {path} has mode {oct(stat.S_IMODE(st.st_mode))}: group or "
                f"other may read it; run 'chmod 600 {path}' (and consider the key leaked if "
                f"others had access)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthenticationError(f"cannot load key file {path}: {exc}; {_HOWTO}") from None
    if secret and not secret_key:
        raise AuthenticationError(f"{path} holds no secret key: expected the .key_secret file "
                                  f"made by 'fastdeploy-sync keys DIR'")
    return public, secret_key


def _resolve(endpoint: str, keys, insecure, side: str):
    """The key directory to use, or None when no CURVE applies: a node-local endpoint, or
    tcp with the insecure opt-in (warned about)."""
    if not needs_auth(endpoint):
        return None
    directory = keys_dir(keys)
    if directory is not None:
        return directory
    if insecure is None:
        insecure = envs.insecure_tcp()
    if insecure:
        log.warning("%s on %s runs WITHOUT authentication or encryption "
                    "(FD_SYNC_INSECURE_TCP=1 or insecure=True): %s. Use it only on a network "
                    "nobody else can reach; to secure it, %s", side, endpoint, _RISK, _HOWTO)
        return None
    raise AuthenticationError(
        f"{side} on {endpoint}: tcp endpoints need CURVE keys, because otherwise {_RISK}. "
        f"To fix: {_HOWTO}. To run without (trusted network only): FD_SYNC_INSECURE_TCP=1")


class _Allowlist:
    """The engine's allowlist as a ZAP credentials provider (``configure_curve_callback``):
    the directory is read again at most every ``RELOAD_S`` seconds, on the handshake that
    needs it, so a key file removed from it (a revoked worker key) is refused on new
    connections within about that time, and one copied in is admitted, without restarting
    the engine. Connections already made stay up (ZAP runs once per handshake): restart
    the worker group to drop them. An allowlist that cannot be read, or is empty, admits
    nobody (fail closed) and says so in the log.

    Runs on the authenticator's thread only. Rereading at most once a second also bounds
    the file reads a flood of handshakes can cause."""

    RELOAD_S = 1.0

    def __init__(self, directory: str, keys):
        self.directory = directory
        self._keys = frozenset(keys)
        self._loaded = time.monotonic()

    def callback(self, domain, z85_key: bytes) -> bool:
        now = time.monotonic()
        if now - self._loaded >= self.RELOAD_S:
            self._reload(now)
        return z85_key in self._keys

    def _reload(self, now):
        self._loaded = now
        try:
            keys = frozenset(zmq.auth.load_certificates(self.directory))
        except (OSError, ValueError) as exc:
            if self._keys:
                log.error("the client allowlist %s cannot be read (%s): every new worker "
                          "connection is refused until it can", self.directory, exc)
            self._keys = frozenset()
            return
        if keys != self._keys:
            log.warning("the client allowlist %s changed: %d key(s) admitted (%d added, %d "
                        "removed); new connections follow it, connections already made stay",
                        self.directory, len(keys), len(keys - self._keys),
                        len(self._keys - keys))
            if not keys:
                log.error("the client allowlist %s is empty: every new worker connection is "
                          "refused", self.directory)
        self._keys = keys


class ServerAuth:
    """The engine side of CURVE: a ZAP authenticator thread on the engine's context that
    admits only the allowlisted client keys, and the engine's key pair for its socket."""

    def __init__(self, authenticator, public: bytes, secret: bytes, allowlist: str):
        self._authenticator = authenticator
        self.public_key = public
        self._secret = secret
        self.allowlist = allowlist

    @classmethod
    def start(cls, ctx: zmq.Context, endpoint: str, keys_dir=None, insecure=None):
        """None for ``ipc://``/``inproc://``, or for tcp with the insecure opt-in
        (``insecure=True`` or ``FD_SYNC_INSECURE_TCP=1``; logs a WARNING).

        Otherwise loads ``DIR/server.key_secret`` and the public keys in
        ``DIR/allowed_clients/`` and starts a ``ThreadAuthenticator`` on ``ctx`` (one per
        context; it binds ZeroMQ's ZAP endpoint). Raises ``AuthenticationError`` if no key
        directory is configured (the message says how to create one), a file cannot be read,
        a secret file is accessible by group/other, or the allowlist is missing or empty.
        Returns promptly (starting the thread waits for it to be ready, milliseconds).

        The allowlist is followed while the engine runs: a key file removed from
        ``allowed_clients/`` is refused on new connections within about a second, one
        copied in is admitted (see ``_Allowlist``).
        """
        directory = _resolve(endpoint, keys_dir, insecure, "TaskQueue")
        if directory is None:
            return None
        public, secret = _load(os.path.join(directory, SERVER_SECRET), secret=True)
        allowlist = os.path.join(directory, ALLOWLIST_DIR)
        try:
            allowed = zmq.auth.load_certificates(allowlist)
        except (OSError, ValueError) as exc:
            raise AuthenticationError(f"cannot read the client allowlist {allowlist}: {exc}; "
                                      f"{_HOWTO}") from None
        if not allowed:
            raise AuthenticationError(
                f"the client allowlist {allowlist} holds no public key, so every worker would "
                f"be refused: copy the workers' client.key into it")
        authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        authenticator.start()
        try:
            # pyzmq looks the provider up by the socket's ZAP domain; "*" is only the
            # fallback for sockets with no domain, not a wildcard, so name ours exactly.
            authenticator.configure_curve_callback(
                domain=ZAP_DOMAIN, credentials_provider=_Allowlist(allowlist, allowed))
        except BaseException:
            authenticator.stop()
            raise
        return cls(authenticator, public, secret, allowlist)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server checked by the authenticator. Call before bind."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public_key
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True

    def close(self) -> None:
        """Stop the authenticator thread (joins it; returns within milliseconds).
        Idempotent. Close it before ``ctx.term()``: it owns a socket of the context."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


class ClientAuth:
    """The worker side of CURVE: this worker's key pair and the engine's pinned public key."""

    def __init__(self, server_public: bytes, public: bytes, secret: bytes, directory: str):
        self.server_key = server_public
        self.public_key = public
        self._secret = secret
        self.keys_dir = directory

    @classmethod
    def load(cls, endpoint: str, keys_dir=None, insecure=None):
        """None for ``ipc://``/``inproc://``, or for tcp with the insecure opt-in (WARNING
        logged). Otherwise loads ``DIR/server.key`` (the engine's public key, pinned) and
        ``DIR/client.key_secret``; ``AuthenticationError`` under the same rules as
        ``ServerAuth.start``. Never blocks."""
        directory = _resolve(endpoint, keys_dir, insecure, "TaskClient")
        if directory is None:
            return None
        server_public, _ = _load(os.path.join(directory, SERVER_PUBLIC), secret=False)
        public, secret = _load(os.path.join(directory, CLIENT_SECRET), secret=True)
        return cls(server_public, public, secret, directory)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client that only talks to the pinned engine. Call before
        connect."""
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self._secret


def missing_key_message(path: str, reason: str = "No such file or directory") -> str:
    """What to do when key file ``path`` cannot be read (``reason``, e.g. the strerror):
    which side needs it, what it is, and where it comes from. Never raises."""
    directory, name = os.path.dirname(path) or ".", os.path.basename(path)
    made = "made by 'fastdeploy-sync keys DIR' on the engine's node"
    if name == SERVER_PUBLIC:
        return (f"this worker cannot read {path} ({reason}): it is the engine's public key, "
                f"which a worker pins to know it talks to the right engine. Copy server.key "
                f"from the engine's key directory ({made}) to {directory}/, or set "
                f"FD_SYNC_KEYS_DIR to a directory that has it")
    if name == CLIENT_SECRET:
        return (f"this worker cannot read {path} ({reason}): it is the worker's own key pair. "
                f"Copy client.key_secret (mode 0600) and client.key from the engine's key "
                f"directory ({made}) to {directory}/; the engine admits the worker when that "
                f"client.key is in its {ALLOWLIST_DIR}/")
    if name == SERVER_SECRET:
        return (f"the engine cannot read {path} ({reason}): it is the engine's key pair. Run "
                f"'fastdeploy-sync keys {directory}' on the engine's node, or set "
                f"FD_SYNC_KEYS_DIR to the directory it made; then copy its server.key, "
                f"client.key and client.key_secret to the worker nodes")
    return f"cannot read key file {path} ({reason}); {_HOWTO}"


def _public_key(path: str):
    """The z85 public key in certificate file ``path`` as text, or None (missing, unreadable,
    not a certificate). For messages only: never raises."""
    try:
        public, _ = zmq.auth.load_certificate(path)
        return public.decode("ascii")
    except Exception:  # noqa: BLE001 -- a message helper must not fail the error it explains
        return None


def handshake_failure_message(event: int, endpoint: str, value: Optional[int] = None,
                              keys=None) -> str:
    """A worker-facing explanation of a socket-monitor handshake failure on ``endpoint``:
    what this worker has, what the engine expects, and the file to copy. Never raises; reads
    the public keys in ``keys`` to quote them.

    ``event`` is the monitor event (``zmq.EVENT_HANDSHAKE_FAILED_*``), ``value`` its value
    (the ZMTP error code or ZAP status code), ``keys`` the worker's key directory, or None
    when this worker uses no CURVE (tcp with ``FD_SYNC_INSECURE_TCP=1``: the worker then
    pinned nothing). What libzmq 4.3.5 reports on the worker's socket (the auth tests
    provoke each case):

    - the engine's allowlist lacks our key: ``EVENT_HANDSHAKE_FAILED_AUTH``, value 400, once
      (libzmq does not retry after a ZAP refusal);
    - the peer is not the engine whose key we pinned (it cannot decrypt our HELLO and drops
      the connection): ``EVENT_HANDSHAKE_FAILED_NO_DETAIL``, value ``EPIPE``, on every
      reconnect (the peer sees ``PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC``);
    - one side speaks CURVE and the other does not (a keyed worker and an engine without
      keys, or the reverse): ``EVENT_HANDSHAKE_FAILED_PROTOCOL`` with
      ``PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH``, or ``NO_DETAIL`` when the peer hangs up
      first.

    A keyed worker cannot tell "another key pinned" from "an engine without keys" from
    "another process holds the port" when the peer just hangs up: the message names each.
    """
    if keys is None:
        # This worker has no keys: whatever the event, the peer wants CURVE (or is not ours).
        return (f"this worker runs without keys (FD_SYNC_INSECURE_TCP=1, no FD_SYNC_KEYS_DIR) "
                f"and the peer at {endpoint} refused its plain connection: the engine there "
                f"requires CURVE keys (or another program holds the port). Copy server.key, "
                f"client.key and client.key_secret from the engine's key directory to this "
                f"node, set FD_SYNC_KEYS_DIR to that directory and unset FD_SYNC_INSECURE_TCP")
    where = os.fspath(keys)
    pinned_file = os.path.join(where, SERVER_PUBLIC)
    secret_file = os.path.join(where, CLIENT_SECRET)
    public_file = os.path.join(where, CLIENT_PUBLIC)
    pinned = _public_key(pinned_file)
    ours = _public_key(secret_file)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if _public_key(public_file) == ours and ours is not None:
            copy = f"Copy {public_file} into the engine's {ALLOWLIST_DIR}/"
        else:
            # No client.key here (or not the public half of our secret): derive it.
            copy = (f"{public_file} is missing or does not match {secret_file}: make it with "
                    f"'grep -v secret-key {secret_file} > {public_file}' and copy that into the "
                    f"engine's {ALLOWLIST_DIR}/")
        return (f"the engine at {endpoint} refused this worker's public key "
                f"{ours or '(unreadable)'} (from {secret_file}; ZAP status {value}): it is not "
                f"in the {ALLOWLIST_DIR}/ directory of the engine's key directory. {copy} (any "
                f"file name ending in .key) and restart the engine, which reads its allowlist "
                f"at start; or use the client.key_secret made together with the engine's keys")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000003):
        return (f"this worker uses CURVE keys ({where}) but the peer at {endpoint} does not: "
                f"the engine there runs without keys (FD_SYNC_INSECURE_TCP=1), or another "
                f"program holds the port. Start the engine with FD_SYNC_KEYS_DIR set to the "
                f"key directory whose server.key this worker pins ({pinned_file}), or, on a "
                f"network nobody else can reach, run this worker without FD_SYNC_KEYS_DIR and "
                f"with FD_SYNC_INSECURE_TCP=1")
    return (f"the peer at {endpoint} hung up on this worker's CURVE handshake, which pins the "
            f"engine key {pinned or '(unreadable)'} from {pinned_file}. Either the engine there "
            f"has another key pair (keys made again on its node, or FD_SYNC_KEYS_DIR pointing at "
            f"another set): copy the engine's current server.key to {pinned_file}, with its "
            f"client.key and client.key_secret; or it runs without keys "
            f"(FD_SYNC_INSECURE_TCP=1): start it with FD_SYNC_KEYS_DIR; or another process "
            f"holds the port")
