"""Names left by processes that exited: SIGTERM with install_signal_cleanup() leaves none,
``fastdeploy-sync clean`` removes what SIGKILL/SIGTERM left and never a live owner's or
another user's names. Real engine and worker processes; every wait is bounded."""

import glob
import os
import signal
import subprocess
import sys
import time

import posix_ipc
import pytest

from conftest import TESTS, needs_pid_namespace
from fastdeploy_sync import envs, names
from workers import wait_until

PROCS = os.path.join(TESTS, "cleanup_procs.py")


def _names(name):
    """Every file of queue ``name`` in /dev/shm and in the ipc directory."""
    # deliberately broad, not built by names: any DP group, and a leftover the library's
    # parser would not read back
    return sorted(glob.glob(f"{names.SHM_DIR}/*fdsync.{name}.*")
                  + glob.glob(os.path.join(envs.ipc_dir(), f"fdsync-{name}-*")))


def _expected(name):
    """What a live TP=2 group with a shared batch holds (the batch's name has the engine's
    pid: matched by prefix)."""
    shm = [names.shm_path(names.group_segment(name, 0)), names.shm_path(names.ack_board(name, 0)),
           *(names.semaphore_path(names.group_semaphore(name, 0, r)) for r in range(2))]
    ipc = [os.path.join(envs.ipc_dir(), names.socket_file(name, 0)),
           os.path.join(envs.ipc_dir(), names.socket_file(name, 0, "put"))]
    return shm + ipc


class Group:
    """An engine and two worker processes of queue ``name``."""

    def __init__(self, name, handler):
        extra = ["--handler"] if handler else []
        self.name = name
        self.procs = {}
        try:
            self.procs["engine"] = self._start("engine", extra)
            self._ready("engine")
            for rank in ("rank0", "rank1"):
                self.procs[rank] = self._start(rank, extra)
            for rank in ("rank0", "rank1"):
                self._ready(rank)
            # both ranks received both batches: the shared batch exists, nothing was taken
            assert wait_until(lambda: set(_expected(name)) <= set(_names(name))
                              and any(".dp0.b" in n for n in _names(name)), 20), _names(name)
        except BaseException:
            self.kill()
            raise

    def _start(self, role, extra):
        return subprocess.Popen([sys.executable, PROCS, role, self.name, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _ready(self, role):
        p = self.procs[role]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline()  # the child prints "ready" or dies (EOF)
            if line.strip() == "ready":
                return
            if not line:
                break
        raise AssertionError(f"{role} not ready: {p.poll()} {p.stderr.read() if p.poll() is not None else ''}")

    def signal(self, signum):
        for p in self.procs.values():
            p.send_signal(signum)
        return {role: p.wait(timeout=30) for role, p in self.procs.items()}

    def kill(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()


def _clean(*argv):
    return subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "clean", *argv],
                          capture_output=True, text=True, timeout=60)


def test_sigterm_with_the_handler_installed_leaves_nothing(name):
    group = Group(name, handler=True)
    try:
        codes = group.signal(signal.SIGTERM)
    finally:
        group.kill()
    assert codes == {"engine": 128 + signal.SIGTERM, "rank0": 128 + signal.SIGTERM,
                     "rank1": 128 + signal.SIGTERM}, codes
    assert _names(name) == []


def test_clean_removes_what_sigterm_left(name):
    """Without the handler SIGTERM's default action kills at once: the names stay, status
    calls them stale, clean --dry-run lists them, clean removes every one."""
    group = Group(name, handler=False)
    try:
        codes = group.signal(signal.SIGTERM)
    finally:
        group.kill()
    assert set(codes.values()) == {-signal.SIGTERM}
    left = _names(name)
    assert set(_expected(name)) <= set(left) and any(".dp0.b" in n for n in left), left
    dry = _clean(name, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert _names(name) == left  # nothing changed
    for path in left:
        assert f"stale    {path}" in dry.stdout, (path, dry.stdout)
    done = _clean(name)
    assert done.returncode == 0, done.stderr
    assert f"removed {len(left)} stale name(s) of {name!r}" in done.stdout, done.stdout
    assert _names(name) == []


def test_clean_removes_a_killed_group_and_refuses_a_live_ones_names(name):
    killed, live = name + "k", name
    dead = Group(killed, handler=False)
    try:
        dead.signal(signal.SIGKILL)
    finally:
        dead.kill()
    assert set(_expected(killed)) <= set(_names(killed))
    group = Group(live, handler=True)
    try:
        before = _names(live)
        out = _clean(live)
        assert out.returncode == 0, out.stderr
        assert _names(live) == before, out.stdout  # a live group's names are never removed
        for path in before:
            assert f"in use   {path}" in out.stdout, (path, out.stdout)
        assert "removed 0 stale name(s)" in out.stdout
        # the live group still works: its engine answers and its segment is intact
        status = subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "status", live],
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0 and "tp_size=2" in status.stdout, status.stdout
        out = _clean(killed)
        assert out.returncode == 0, out.stderr
        assert _names(killed) == [], out.stdout
        assert _names(live) == before
    finally:
        codes = group.signal(signal.SIGTERM)
        group.kill()
    assert set(codes.values()) == {128 + signal.SIGTERM}
    assert _names(live) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file of another uid")
def test_another_users_names_are_never_touched(name):
    seg_name, sem_name = names.group_segment(name, 0), names.group_semaphore(name, 0, 0)
    seg_path, sem_path = names.shm_path(seg_name), names.semaphore_path(sem_name)
    seg = posix_ipc.SharedMemory(seg_name, posix_ipc.O_CREX, mode=0o600, size=4096)
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=0o600)
    try:
        os.fchown(seg.fd, 4242, 4242)
        os.chown(sem_path, 4242, 4242)
        out = _clean(name)
        assert out.returncode == 0, out.stderr
        assert f"not ours {seg_path} " in out.stdout, out.stdout
        assert f"not ours {sem_path} " in out.stdout, out.stdout
        assert "owned by uid 4242" in out.stdout
        assert os.path.exists(seg_path)
        assert os.path.exists(sem_path)
    finally:
        seg.close_fd()
        posix_ipc.unlink_shared_memory(seg.name)
        sem.close()
        posix_ipc.unlink_semaphore(sem_name)


def test_a_segment_being_created_is_kept_until_it_is_old(name):
    """A creator writes the owner pid right after creating: a segment without it is kept
    while it is young, and counts as stale once it has not changed for CREATING_GRACE_S."""
    from fastdeploy_sync.cleanup import CREATING_GRACE_S

    seg = posix_ipc.SharedMemory(names.ack_board(name, 0), posix_ipc.O_CREX, mode=0o600,
                                 size=4096)
    seg.close_fd()
    path = names.shm_path(names.ack_board(name, 0))
    try:
        out = _clean(name)
        assert "in use   " + path in out.stdout and "being created" in out.stdout, out.stdout
        assert os.path.exists(path)
        old = time.time() - CREATING_GRACE_S - 5
        os.utime(path, (old, old))
        out = _clean(name)
        assert "removed  " + path in out.stdout and "owner never written" in out.stdout, out.stdout
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            posix_ipc.unlink_shared_memory(names.ack_board(name, 0))


def test_importing_the_library_takes_no_signal_and_no_prometheus():
    # compared with what the process had before the import: a shell running this suite in
    # the background hands its children SIGINT ignored
    code = ("import signal, sys; before = [signal.getsignal(s) for s in (signal.SIGTERM, "
            "signal.SIGINT)]; import fastdeploy_sync; "
            "print([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before, "
            "before[0] is signal.SIG_DFL, 'prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "False"], out.stdout + out.stderr


def test_install_signal_cleanup_chains_the_previous_handler(tmp_path):
    marker = tmp_path / "previous-ran"
    code = f"""
import signal, sys, time
def previous(signum, frame):
    open({str(marker)!r}, "w").write(str(signum))
signal.signal(signal.SIGTERM, previous)
from fastdeploy_sync import install_signal_cleanup
restore = install_signal_cleanup()
restore()
assert signal.getsignal(signal.SIGTERM) is previous
install_signal_cleanup()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("unwound", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert marker.read_text() == str(int(signal.SIGTERM))
    assert rest.strip() == "unwound"  # finally blocks ran: normal interpreter shutdown


def test_the_profile_sweeps_what_its_killed_processes_left_and_nothing_else(name):
    """`fastdeploy-sync profile` kills a process that does not exit within its bound (a
    loaded machine): the names that process left (here a SIGKILLed group of the run's)
    are removed when the run ends, and a live group whose name is also the run's is kept
    (it left a TP group segment and its semaphores behind in a loaded full-suite run)."""
    from fastdeploy_sync.profiling import runner

    killed, live = name + "s0", name + "m"
    dead = Group(killed, handler=False)
    try:
        dead.signal(signal.SIGKILL)
    finally:
        dead.kill()
    assert _names(killed)
    group = Group(live, handler=False)
    try:
        before = _names(live)
        runner._sweep([killed, live])
        assert _names(killed) == []
        assert _names(live) == before
    finally:
        group.kill()
    runner._sweep([live])
    assert _names(live) == []


_HOLDER = """
import os, sys, time
from fastdeploy_sync.shm.segment import Segment
from fastdeploy_sync.shm.segment import OWNER_PID
seg = Segment.create(sys.argv[1], 4096)
seg.view[OWNER_PID] = int(sys.argv[2])   # the pid its creator saw (another namespace's)
print("ready", flush=True)
if sys.argv[3] == "exit":
    os._exit(0)                             # killed: no close, no unlink
time.sleep(60)
"""


def test_clean_decides_by_the_owner_lock_not_by_a_recorded_pid(name):
    """Pids lie both ways: a leftover whose recorded pid now belongs to another live
    process (reuse) is stale; a live owner whose recorded pid means nothing here (another
    pid namespace sharing /dev/shm, as containers with --ipc=host do) is in use."""
    reused, foreign = names.group_segment(name + "r", 0), names.group_segment(name + "f", 0)
    holder = None
    try:
        # a creator that exited, its recorded pid now a live process's (ours)
        out = subprocess.run([sys.executable, "-c", _HOLDER, reused, str(os.getpid()), "exit"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "ready", out.stderr
        # a live creator whose recorded pid is nobody's in this namespace
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, foreign, "4194000", "stay"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "ready"
        out = _clean(name + "r")
        assert out.returncode == 0, out.stderr
        assert "removed  " + names.shm_path(reused) in out.stdout, out.stdout
        assert not os.path.exists(names.shm_path(reused))
        out = _clean(name + "f")
        assert out.returncode == 0, out.stderr
        assert "in use   " + names.shm_path(foreign) in out.stdout, out.stdout
        assert os.path.exists(names.shm_path(foreign))
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=30)
            holder.stdout.close()
        for seg in (reused, foreign):
            try:
                posix_ipc.unlink_shared_memory(seg)
            except posix_ipc.ExistentialError:
                pass


@needs_pid_namespace
@pytest.mark.parametrize("where", ["pool", "own segment"])
def test_clean_from_another_pid_namespace_leaves_a_live_group_alone(name, where, monkeypatch):
    """A sidecar container sharing /dev/shm (a pid namespace of its own) runs clean: every
    pid it reads is nobody's there. The live group's shared batch (in the pool, or in a
    segment of its own with a 1 MiB pool) and pool must be kept, judged by the locks their
    engine holds, not by the pid in their names. Before: removed, and both ranks lost the
    group."""
    if where == "own segment":
        monkeypatch.setenv("FD_SYNC_SHM_POOL_MB", "1")  # the 2 MiB batch takes its own
    group = Group(name, handler=True)
    try:
        before = _names(name)
        shared = [n for n in before if ".dp0.b" in n]
        assert shared and any((".dp0.bp" in n) == (where == "pool") for n in shared), before
        out = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m",
                              "fastdeploy_sync.cli", "clean", name], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "removed 0 stale name(s)" in out.stdout, out.stdout
        for path in shared:
            assert f"in use   {path}" in out.stdout, out.stdout
        assert _names(name) == before
        assert all(p.poll() is None for p in group.procs.values())  # nobody lost the group
    finally:
        codes = group.signal(signal.SIGTERM)
        group.kill()
    assert set(codes.values()) == {128 + signal.SIGTERM}, codes
    assert _names(name) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant names of another uid")
def test_clean_as_root_never_removes_another_users_symlink(name, tmp_path):
    """Names are judged with lstat: a symlink another user (nobody) planted among our names
    is neither followed nor removed, even where the name looks stale (a semaphore whose
    segment is gone). Before: root removed it."""
    target = tmp_path / "ours"
    target.write_bytes(b"x" * 32)  # a regular file of root's: what stat() would have seen
    planted = [names.semaphore_path(names.group_semaphore(name, 0, 0)),
               names.shm_path(names.batch_segment(name, 0, 1, 99999))]
    try:
        for path in planted:
            os.symlink(target, path)
            os.lchown(path, 65534, 65534)
        out = _clean(name)
        assert out.returncode == 0, out.stderr
        for path in planted:
            assert os.path.islink(path), out.stdout
            assert f"not ours {path} " in out.stdout, out.stdout
        assert "removed 0 stale name(s)" in out.stdout
    finally:
        for path in planted:
            if os.path.lexists(path):
                os.unlink(path)


# Run by the test below in a child that becomes nobody: imports first (the interpreter's
# own files may not be readable by nobody), then plants nobody's own stale batch and runs
# clean, whose exit status and output it passes on.
_CLEAN_AS_NOBODY = """
import os, sys
import posix_ipc
from fastdeploy_sync import cli, names
cli.build_parser()  # imports what the commands need while we may still read them
name = sys.argv[1]
os.environ.pop("XDG_RUNTIME_DIR", None)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
seg = posix_ipc.SharedMemory(names.batch_segment(name, 0, 2, 99999), posix_ipc.O_CREX,
                             mode=0o600, size=4096)
seg.close_fd()
sys.exit(cli.main(["clean", name]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_clean_as_an_unprivileged_user_skips_what_it_may_not_touch(name, tmp_path):
    """As nobody, next to root's names (a segment, a semaphore, a batch, a symlink into a
    directory nobody may not read): exit 0, no traceback, one line per name, nobody's own
    stale batch removed, root's left alone. Before: 'Permission denied' aborted the whole
    clean (exit 1) at the symlink it followed."""
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    roots = []
    seg = posix_ipc.SharedMemory(names.group_segment(name, 0), posix_ipc.O_CREX, mode=0o644,
                                 size=4096)
    seg.close_fd()
    roots.append(names.shm_path(names.group_segment(name, 0)))
    batch = posix_ipc.SharedMemory(names.batch_segment(name, 0, 1, 99998), posix_ipc.O_CREX,
                                   mode=0o644, size=4096)
    batch.close_fd()
    roots.append(names.shm_path(names.batch_segment(name, 0, 1, 99998)))
    posix_ipc.Semaphore(names.group_semaphore(name, 0, 0), posix_ipc.O_CREX, mode=0o644).close()
    roots.append(names.semaphore_path(names.group_semaphore(name, 0, 0)))
    os.symlink(secret / "nothing", names.semaphore_path(names.group_semaphore(name, 0, 1)))
    roots.append(names.semaphore_path(names.group_semaphore(name, 0, 1)))
    mine = names.shm_path(names.batch_segment(name, 0, 2, 99999))
    try:
        out = subprocess.run([sys.executable, "-c", _CLEAN_AS_NOBODY, name],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Traceback" not in out.stderr and out.stderr == "", out.stderr
        assert f"removed  {mine} " in out.stdout, out.stdout
        assert not os.path.lexists(mine)
        for path in roots:
            assert os.path.lexists(path), path
            assert f"not ours {path} " in out.stdout, out.stdout
    finally:
        for path in roots + [mine]:
            if os.path.lexists(path):
                os.unlink(path)


_DROPIN_SERVER = """
import sys, time
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=sys.argv[1])
print("ready", flush=True)
time.sleep(60)
"""


def test_clean_removes_a_killed_dropin_servers_side_channel_socket(name):
    """The drop-in's server binds a socket of its own for the side channels
    (``.side.ipc``): after a SIGKILL, clean lists it as stale and removes it like the
    engine's sockets (it was left behind before: clean did not know the name)."""
    proc = subprocess.Popen([sys.executable, "-c", _DROPIN_SERVER, name], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        side = os.path.join(envs.ipc_dir(), f"fdsync-{name}-dp0.side.ipc")
        assert os.path.exists(side)
        live = _clean(name, "--dry-run")
        assert f"in use   {side}" in live.stdout, live.stdout
    finally:
        proc.kill()
        proc.wait(timeout=10)
    dry = _clean(name, "--dry-run")
    assert f"stale    {side}" in dry.stdout and "side channels" in dry.stdout, dry.stdout
    out = _clean(name)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(side)
    left = _names(name)
    assert left == [] or all(os.path.exists(p) is False for p in left), left
    assert _clean(name).stdout.startswith("removed 0"), "clean left something it listed"
