"""``fastdeploy_sync.fastdeploy.install()``: FastDeploy's every use of ``EngineWorkerQueue`` gets
the drop-in, in the process that calls it and in the processes it starts afterwards. Run
against a fake ``fastdeploy`` package in a temporary directory whose modules import the
class the ways FastDeploy's do (read from its engine, worker, splitwise connector and cache
messager); each scenario runs in a fresh interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT  # noqa: E402

FAKE = {
    "fastdeploy/__init__.py": "",
    "fastdeploy/inter_communicator/__init__.py":
        "from .engine_worker_queue import EngineWorkerQueue\nfrom .ipc_signal import IPCSignal\n",
    "fastdeploy/inter_communicator/ipc_signal.py": "class IPCSignal:\n    pass\n",
    "fastdeploy/inter_communicator/engine_worker_queue.py":
        "class EngineWorkerQueue:\n    FASTDEPLOYS_OWN = True\n",
    "fastdeploy/worker/__init__.py": "",
    "fastdeploy/worker/worker_process.py":
        "from fastdeploy.inter_communicator import EngineWorkerQueue as TaskQueue\n",
    "fastdeploy/cache_manager/__init__.py": "",
    "fastdeploy/cache_manager/cache_messager.py":
        "from fastdeploy.inter_communicator import EngineWorkerQueue, IPCSignal\n",
    "fastdeploy/splitwise/__init__.py": "",
    "fastdeploy/splitwise/splitwise_connector.py":
        "from fastdeploy.inter_communicator.engine_worker_queue import EngineWorkerQueue\n",
}
CHECK = textwrap.dedent("""
    import fastdeploy.inter_communicator as package
    import fastdeploy.inter_communicator.engine_worker_queue as module
    import fastdeploy.worker.worker_process as worker
    import fastdeploy.cache_manager.cache_messager as messager
    import fastdeploy.splitwise.splitwise_connector as connector
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue
    uses = [package.EngineWorkerQueue, module.EngineWorkerQueue, worker.TaskQueue,
            messager.EngineWorkerQueue, connector.EngineWorkerQueue]
    print("drop-in" if all(u is EngineWorkerQueue for u in uses) else
          "fastdeploy's: " + repr([u.__module__ for u in uses]))
""")


@pytest.fixture
def fake_fastdeploy(tmp_path):
    for path, text in FAKE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def _python(code, fake, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), ROOT])
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_without_install_fastdeploy_keeps_its_own(fake_fastdeploy):
    """The check can fail: without install() every use is FastDeploy's class."""
    assert _python(CHECK, fake_fastdeploy)[-1].startswith("fastdeploy's")


def test_install_before_fastdeploy_is_imported(fake_fastdeploy):
    code = "from fastdeploy_sync.fastdeploy import install\ninstall()\n" + CHECK
    assert _python(code, fake_fastdeploy)[-1] == "drop-in"


def test_install_after_fastdeploy_was_imported(fake_fastdeploy):
    """Modules that bound FastDeploy's class already (under any name) are patched too."""
    code = ("import fastdeploy.worker.worker_process, fastdeploy.cache_manager.cache_messager\n"
            "from fastdeploy_sync.fastdeploy import install\ninstall()\n" + CHECK)
    assert _python(code, fake_fastdeploy)[-1] == "drop-in"


def test_processes_started_afterwards_get_it(fake_fastdeploy):
    """FastDeploy starts its workers and cache messagers as Python processes of their own:
    after install(), a process started from this one (environment inherited, nothing else
    done in it) uses the drop-in; a process that never imports FastDeploy imports neither
    FastDeploy nor this library because of the hook ('fastdeploy' prefixes both)."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        from fastdeploy_sync.fastdeploy import install
        install()
        child = subprocess.run([sys.executable, "-c", {CHECK!r}], capture_output=True,
                               text=True, timeout=60)
        print(child.stdout.strip() or child.stderr)
        probe = "import sys; print(any(m.startswith('fastdeploy') for m in sys.modules))"
        idle = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=60)
        print(idle.stdout.strip())
    """)
    lines = _python(code, fake_fastdeploy)
    assert lines[-2:] == ["drop-in", "False"], lines


def test_a_child_that_would_lose_the_hook_is_reported(fake_fastdeploy):
    """After install(), a Python child started with -S (no site, so no hook) keeps
    FastDeploy's class: the process that starts it says so on stderr, naming the command."""
    code = textwrap.dedent(f"""
        import subprocess, sys
        from fastdeploy_sync.fastdeploy import install
        install()
        child = subprocess.run([sys.executable, "-S", "-c",
                                "import sys; sys.path.insert(0, {str(fake_fastdeploy)!r}); "
                                "from fastdeploy.inter_communicator import EngineWorkerQueue; "
                                "print(EngineWorkerQueue.__module__)"],
                               capture_output=True, text=True, timeout=60)
        print(child.stdout.strip() or child.stderr)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_fastdeploy), ROOT])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fastdeploy.inter_communicator.engine_worker_queue", out.stdout
    assert "starts a Python process without the FastDeploy drop-in's hook" in out.stderr
    assert "-S (no site" in out.stderr
