"""``fastdeploy-sync run -- COMMAND``: the drop-in in the command and in every Python process it
starts, each saying it took it; a Python child that would lose the hook reported (or refused
with ``--strict``); a command the hook cannot reach refused; the command's exit status and
signals are its own; ``fastdeploy-sync status`` lists the processes and their roles.

Against a stand-in ``fastdeploy`` package in a temporary directory whose
``inter_communicator/__init__.py`` imports the class as FastDeploy's does
(``from .engine_worker_queue import EngineWorkerQueue`` among its other imports)."""

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT  # noqa: E402

STAND_IN = {
    "fastdeploy/__init__.py": "",
    "fastdeploy/inter_communicator/__init__.py":
        "from .engine_cache_queue import EngineCacheQueue\n"
        "from .engine_worker_queue import EngineWorkerQueue\n"
        "from .ipc_signal import IPCSignal\n",
    "fastdeploy/inter_communicator/engine_cache_queue.py": "class EngineCacheQueue:\n    pass\n",
    "fastdeploy/inter_communicator/ipc_signal.py": "class IPCSignal:\n    pass\n",
    "fastdeploy/inter_communicator/engine_worker_queue.py":
        "class EngineWorkerQueue:\n    FASTDEPLOYS_OWN = True\n",
}
DROP_IN = "fastdeploy_sync.fastdeploy.queue"
FASTDEPLOYS = "fastdeploy.inter_communicator.engine_worker_queue"

# Prints "<depth> <pid> <the class's module>", then starts the next depth as a child: the
# child with an argument list, the grandchild with a shell line (as FastDeploy's engine
# starts its workers: subprocess.Popen("python -m paddle.distributed.launch ...", shell=True)).
NESTED = textwrap.dedent("""
    import os, shlex, subprocess, sys
    depth = int(sys.argv[1])
    from fastdeploy.inter_communicator import EngineWorkerQueue
    print(depth, os.getpid(), EngineWorkerQueue.__module__, flush=True)
    if depth == 0:
        subprocess.run([sys.executable, __file__, "1"], check=True, timeout=60)
    elif depth == 1:
        line = f"cd / && {shlex.quote(sys.executable)} -u {shlex.quote(__file__)} 2"
        subprocess.run(line, shell=True, check=True, timeout=60)
""")
# A process of the command starts children that lose the hook, each its own way.
LOSING = textwrap.dedent("""
    import os, subprocess, sys
    show = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
            "from fastdeploy.inter_communicator import EngineWorkerQueue as Q; "
            "print(sys.argv[2], Q.__module__)", os.path.dirname(__file__)]
    runs = [(show[:1] + ["-S"] + show[1:] + ["dash-S"], {}),
            (show + ["no-hook-env"],
             {"env": {"PATH": os.environ["PATH"], "PYTHONPATH": os.path.dirname(__file__)}}),
            ("python3 -I -c 'print(1)' # shell", {"shell": True})]
    for args, kwargs in runs:
        try:
            subprocess.run(args, timeout=60, **kwargs)
        except PermissionError as exc:
            print("refused:", str(exc)[:60], flush=True)
""")


@pytest.fixture
def stand_in(tmp_path):
    for path, text in STAND_IN.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700)
    return tmp_path


def _env(stand_in, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FD_SYNC_RUN",
                                                            "FD_SYNC_RUN_STRICT")}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath or [str(stand_in), ROOT])
    env["FD_SYNC_IPC_DIR"] = str(stand_in / "ipc")  # the records of this test alone
    return env


def _cli(*args):
    return [sys.executable, "-m", "fastdeploy_sync.cli", *args]


def _run(stand_in, args, pythonpath=None, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, env=_env(stand_in, pythonpath),
                          cwd=stand_in, timeout=timeout)


def _script(stand_in, name, text):
    path = stand_in / name
    path.write_text(text)
    return str(path)


def _took(stderr):
    return {int(p) for p in re.findall(r"pid (\d+) took the FastDeploy drop-in", stderr)}


def test_without_run_fastdeploy_keeps_its_own(stand_in):
    """The check can fail: the same command without the wrapper keeps FastDeploy's class in
    every process, and nothing says it took the drop-in."""
    prog = _script(stand_in, "nested.py", NESTED)
    out = _run(stand_in, [sys.executable, prog, "0"])
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [(d, m) for d, _, m in lines] == [("0", FASTDEPLOYS), ("1", FASTDEPLOYS),
                                            ("2", FASTDEPLOYS)]
    assert not _took(out.stderr)


def test_run_swaps_the_class_in_the_command_a_child_and_a_grandchild(stand_in):
    prog = _script(stand_in, "nested.py", NESTED)
    out = _run(stand_in, _cli("run", "--", sys.executable, prog, "0"))
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [(d, m) for d, _, m in lines] == [("0", DROP_IN), ("1", DROP_IN), ("2", DROP_IN)]
    # each process said it took it: the three pids that printed
    assert _took(out.stderr) == {int(pid) for _, pid, _ in lines}, out.stderr


def test_a_child_that_would_lose_the_hook_is_reported_by_its_parent(stand_in):
    """python -S, an environment without the hook, python -I in a shell line: each child
    keeps FastDeploy's class (it cannot say so itself), and its parent says it on stderr."""
    prog = _script(stand_in, "losing.py", LOSING)
    out = _run(stand_in, _cli("run", "--", sys.executable, prog))
    assert out.returncode == 0, out.stderr
    assert f"dash-S {FASTDEPLOYS}" in out.stdout and f"no-hook-env {FASTDEPLOYS}" in out.stdout
    warnings = [line for line in out.stderr.splitlines()
                if "starts a Python process without the FastDeploy drop-in's hook" in line]
    assert len(warnings) == 3, out.stderr
    assert "-S (no site" in warnings[0] and "dash-S" in warnings[0]
    assert "does not hold the hook directory" in warnings[1] and "no-hook-env" in warnings[1]
    assert "-I (isolated" in warnings[2] and "# shell" in warnings[2]


def test_strict_refuses_to_start_such_a_child(stand_in):
    prog = _script(stand_in, "losing.py", LOSING)
    out = _run(stand_in, _cli("run", "--strict", "--", sys.executable, prog))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused: fastdeploy_sync: pid") == 3, out.stdout
    assert FASTDEPLOYS not in out.stdout  # none of them ran


@pytest.mark.parametrize("flag", ["-S", "-I", "-E", "-uS"])
def test_a_command_the_hook_cannot_reach_is_refused(stand_in, flag):
    out = _run(stand_in, _cli("run", "--", sys.executable, flag, "-c", "print('ran')"))
    assert out.returncode == 2
    assert "ran" not in out.stdout
    assert "refusing to start" in out.stderr and flag[-1:] in out.stderr


def test_usage_errors(stand_in):
    assert _run(stand_in, _cli("run")).returncode == 2
    out = _run(stand_in, _cli("run", "--", "no-such-command-fdsync"))
    assert out.returncode == 127 and "command not found" in out.stderr


def test_exit_status_pid_and_signals_are_the_commands(stand_in):
    out = _run(stand_in, _cli("run", "--", sys.executable, "-c", "raise SystemExit(7)"))
    assert out.returncode == 7, out.stderr
    # Python ignores SIGPIPE for itself; the command must not inherit that
    out = _run(stand_in, _cli("run", "--", "sh", "-c", "grep SigIgn /proc/$$/status"))
    ignored = int(out.stdout.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), out.stdout
    # the command is the wrapper's process: same pid, and a signal to it reaches the command
    code = "import os, sys, time; print(os.getpid(), flush=True); time.sleep(60)"
    proc = subprocess.Popen(_cli("run", "--", sys.executable, "-c", code), text=True,
                            stdout=subprocess.PIPE, env=_env(stand_in))
    try:
        assert int(proc.stdout.readline()) == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_existing_pythonpath_and_sitecustomize_are_kept(stand_in):
    theirs = stand_in / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS = 'ran'\n")
    (theirs / "their_module.py").write_text("VALUE = 42\n")
    code = ("import their_module\nfrom fastdeploy.inter_communicator import EngineWorkerQueue"
            "\nprint(THEIRS, their_module.VALUE, EngineWorkerQueue.__module__)")
    out = _run(stand_in, _cli("run", "--", sys.executable, "-c", code),
               pythonpath=[str(theirs), str(stand_in), ROOT])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "42", DROP_IN]


SERVE = textwrap.dedent("""
    import os, sys
    from fastdeploy.inter_communicator import EngineWorkerQueue
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1)
    engine = EngineWorkerQueue(address=server.address, num_client=1, client_id=0)
    pid = os.fork()
    if pid == 0:  # a forked child exiting normally leaves its parent's record alone
        sys.exit(0)
    os.waitpid(pid, 0)
    print(server.address[1], flush=True)
    sys.stdin.readline()
    engine.cleanup()
    server.cleanup()
""")


def test_status_lists_the_processes_and_their_roles(stand_in):
    prog = _script(stand_in, "serve.py", SERVE)
    env = _env(stand_in)
    proc = subprocess.Popen(_cli("run", "--", sys.executable, prog), text=True, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=stand_in)
    try:
        port = int(proc.stdout.readline())
        status = _run(stand_in, _cli("status"), timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        row = [line for line in status.stdout.splitlines() if line.split()[:1] == [str(proc.pid)]]
        assert len(row) == 1, status.stdout
        assert f"server + engine of fdq{port} dp 0; engine of fdq{port} dp 0" in row[0]
        assert f" {proc.pid}  yes " in row[0] and "serve.py" in row[0]
        named = _run(stand_in, _cli("status", f"fdq{port}"), timeout=60)
        assert named.returncode == 0 and f"server + engine of fdq{port}" in named.stdout
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    status = _run(stand_in, _cli("status"), timeout=60)
    assert status.returncode == 1 and "no process" in status.stdout
    assert os.listdir(stand_in / "ipc" / "dropin") == []


def test_a_killed_process_record_is_not_listed_and_clean_removes_it(stand_in, name):
    """A process killed by SIGKILL cannot remove its record: status does not list it (its
    lock is free), clean --dry-run counts it, clean removes it."""
    code = ("import sys\nfrom fastdeploy.inter_communicator import EngineWorkerQueue\n"
            "print('took', flush=True)\nsys.stdin.readline()\n")
    proc = subprocess.Popen(_cli("run", "--", sys.executable, "-c", code), text=True,
                            env=_env(stand_in), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=stand_in)
    try:
        assert proc.stdout.readline().strip() == "took"
        listed = _run(stand_in, _cli("status"), timeout=60)
        assert f"{proc.pid} " in listed.stdout and " yes " in listed.stdout, listed.stdout
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stdin.close()
    records = stand_in / "ipc" / "dropin"
    assert len(os.listdir(records)) == 2  # the killed process's .json and .lock
    assert _run(stand_in, _cli("status"), timeout=60).returncode == 1
    # NAME: this test's alone, so that no other test's leftovers are touched
    dry = _run(stand_in, _cli("clean", name, "--dry-run"), timeout=60)
    assert "would remove the records of 1 exited drop-in process(es)" in dry.stdout, dry.stdout
    assert len(os.listdir(records)) == 2
    cleaned = _run(stand_in, _cli("clean", name), timeout=60)
    assert "removed the records of 1 exited drop-in process(es)" in cleaned.stdout
    assert os.listdir(records) == []
