"""``fastdeploy-sync run -- COMMAND...``: run a command (FastDeploy's launch, unchanged) with the
drop-in installed in it and in every Python process it starts.

It replaces this process by ``COMMAND`` (``os.execvpe``: the command keeps this pid, so a
supervisor's signals reach it and its exit status is the command's), with an environment
whose ``PYTHONPATH`` starts with the hook directory (``install.hooked_environ``; an existing
``PYTHONPATH`` is kept after it, and a ``sitecustomize`` it shadows still runs) and
``FD_SYNC_RUN`` set to that pid. In each Python process of the command the hook swaps
FastDeploy's ``EngineWorkerQueue`` for the drop-in when FastDeploy imports it; each process
that takes it says so on stderr and is listed by ``fastdeploy-sync status`` with its roles
(``processes``); each Python child that would start without the hook is reported by the
process that starts it (``subprocess_hook.fdsync_spawn_check``), or refused with
``--strict``.

A command that is itself a Python interpreter the hook cannot reach (``python -S``, ``-I``,
``-E``, or a script whose ``#!`` line says so) is refused before anything runs.
"""

import os
import signal
import sys

from .install import hooked_environ
from .processes import RUN_ENV
from .subprocess_hook import fdsync_spawn_check

__all__ = ["run", "USAGE_ERROR"]

USAGE_ERROR = 2
# The shell's statuses for a command that cannot be run (not found, not executable).
_NOT_FOUND, _NOT_EXECUTABLE = 127, 126
# Dispositions Python sets for itself at start (ignored) that an exec would hand on to the
# command; subprocess's restore_signals resets the same ones.
_PYTHONS_OWN_IGNORED = ("SIGPIPE", "SIGXFSZ", "SIGXFZ")


def run(command, strict: bool = False) -> int:
    """Replace this process by ``command`` (a list: program and arguments, found on
    ``PATH``) with the drop-in's hook in its environment (see the module docstring);
    ``strict``: a Python child that would lose the hook fails to start
    (``PermissionError`` in the process that starts it) instead of being reported.

    Returns only when the command cannot run: ``USAGE_ERROR`` (2) for no command or one
    the hook cannot reach, 127 not found, 126 not executable, each said on stderr."""
    if not command:
        print("fastdeploy-sync run: no command given: fastdeploy-sync run -- COMMAND [ARGS...] "
              "(e.g. -- python -m fastdeploy.entrypoints.openai.api_server ...)",
              file=sys.stderr)
        return USAGE_ERROR
    env = hooked_environ(os.environ)
    env[RUN_ENV] = str(os.getpid())
    if strict:
        env[fdsync_spawn_check.STRICT_ENV] = "1"
    else:
        env.pop(fdsync_spawn_check.STRICT_ENV, None)
    problem = fdsync_spawn_check.lost_hook(command, env)
    if problem:
        print(f"fastdeploy-sync run: refusing to start {command[0]}: {problem}, so the "
              f"FastDeploy drop-in could not be installed in it. Start it without -S/-I/-E "
              f"(its children too).", file=sys.stderr)
        return USAGE_ERROR
    for name in _PYTHONS_OWN_IGNORED:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) == signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"fastdeploy-sync run: {command[0]}: command not found (PATH: "
              f"{env.get('PATH', os.defpath)})", file=sys.stderr)
        return _NOT_FOUND
    except OSError as exc:
        print(f"fastdeploy-sync run: {command[0]}: cannot run it: {exc.strerror or exc}",
              file=sys.stderr)
        return _NOT_EXECUTABLE
    raise AssertionError("unreachable: execvpe returned")
