"""The private ipc directory and the fd headroom check (files and descriptors only)."""

import os
import stat
import tempfile

import pytest

from fastdeploy_sync import envs
from fastdeploy_sync.engine.queue import TaskQueue
from fastdeploy_sync.wire.endpoints import (
    check_ipc_endpoint,
    check_private_dir,
    claim_ipc_path,
    default_endpoint,
    ipc_path,
    private_dir,
)
from fastdeploy_sync.wire.sockets import CLIENT_FDS, ensure_free_fds  # noqa: E402

OTHER = 12345


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_default_dir_under_xdg_runtime_dir_is_created_0700(ipc_env, monkeypatch):
    runtime = ipc_env / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    old = os.umask(0o022)
    try:
        ep = default_endpoint("llm", 0)
    finally:
        os.umask(old)
    assert ep == f"ipc://{runtime}/fastdeploy_sync/fdsync-llm-dp0.ipc"
    assert _mode(runtime / "fastdeploy_sync") == 0o700


def test_default_dir_falls_back_to_per_uid_temp_dir(ipc_env, monkeypatch):
    # XDG_RUNTIME_DIR that is not ours is ignored
    monkeypatch.setattr(tempfile, "tempdir", str(ipc_env))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(ipc_env / "missing"))
    assert envs.ipc_dir() == str(ipc_env / f"fastdeploy_sync-{os.geteuid()}")
    old = os.umask(0o277)  # a umask that would even strip our own write bit
    try:
        ep = default_endpoint("llm", 1)
    finally:
        os.umask(old)
    assert ipc_path(ep) == str(ipc_env / f"fastdeploy_sync-{os.geteuid()}" / "fdsync-llm-dp1.ipc")
    assert _mode(envs.ipc_dir()) == 0o700


@needs_root
def test_xdg_runtime_dir_of_another_user_is_not_used(ipc_env, monkeypatch):
    runtime = ipc_env / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, OTHER, OTHER)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(tempfile, "tempdir", str(ipc_env))
    assert envs.ipc_dir() == str(ipc_env / f"fastdeploy_sync-{os.geteuid()}")


@needs_root
def test_directory_of_another_user_is_refused(ipc_env, monkeypatch):
    d = ipc_env / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER, OTHER)
    with pytest.raises(PermissionError, match=rf"{d} is owned by uid {OTHER} \(mode 0o700\)"):
        private_dir(str(d))
    # the engine refuses it too, before binding anything
    monkeypatch.setenv("FD_SYNC_IPC_DIR", str(d))
    with pytest.raises(PermissionError, match=f"uid {OTHER}.*FD_SYNC_IPC_DIR"):
        TaskQueue("llm", 1)
    assert os.listdir(d) == []
    with pytest.raises(PermissionError, match=f"uid {OTHER}"):
        check_ipc_endpoint(str(d / "fdsync-llm-dp0.ipc"))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_group_or_other_writable_dir_is_refused(ipc_env, mode):
    d = ipc_env / "loose"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PermissionError, match=rf"mode {oct(mode)}: writable by group or other.*chmod 700"):
        private_dir(str(d))
    with pytest.raises(PermissionError):
        claim_ipc_path(str(d / "x.ipc"))
    with pytest.raises(PermissionError):
        check_ipc_endpoint(str(d / "x.ipc"))


def test_symlinked_dir_is_refused(ipc_env):
    real = ipc_env / "real"
    real.mkdir(mode=0o700)
    link = ipc_env / "link"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match=f"{link} is a symlink"):
        private_dir(str(link))
    with pytest.raises(PermissionError, match="symlink"):
        check_private_dir(str(link))


def test_non_socket_file_is_refused(ipc_env):
    d = private_dir(str(ipc_env / "ours"))
    path = os.path.join(d, "fdsync-llm-dp0.ipc")
    open(path, "w").close()
    with pytest.raises(PermissionError, match="is not a socket"):
        claim_ipc_path(path)
    assert os.path.exists(path)


def test_ensure_free_fds_passes_and_leaves_no_fd_open():
    before = sorted(os.listdir("/proc/self/fd"))
    ensure_free_fds(CLIENT_FDS, "test")
    assert sorted(os.listdir("/proc/self/fd")) == before
