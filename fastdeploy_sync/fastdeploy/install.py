"""``install()``: make FastDeploy use the drop-in everywhere it builds an ``EngineWorkerQueue``.

FastDeploy imports the class in several places and several ways (``from
fastdeploy.inter_communicator import EngineWorkerQueue`` in its engine, IPC manager, splitwise
connector and cache messager; ``... import EngineWorkerQueue as TaskQueue`` in its worker;
``from fastdeploy.inter_communicator.engine_worker_queue import EngineWorkerQueue`` elsewhere),
and in several processes (its workers and cache messagers are separate Python processes
started by the engine). Swapping one import line swaps one of them.

``install()`` swaps all: in this process an import hook replaces the class in
``fastdeploy.inter_communicator.engine_worker_queue`` the moment that module has run, so the
package's own ``from .engine_worker_queue import EngineWorkerQueue`` and every later import
get the drop-in (modules that imported FastDeploy's class already are patched too); and the
processes started from this one afterwards do the same at their start (a ``sitecustomize`` on
``PYTHONPATH``, see ``subprocess_hook``). Nothing of FastDeploy is imported by it.
"""

import importlib.abc
import os
import sys
import threading

from .processes import took_dropin
from .subprocess_hook import fdsync_spawn_check

__all__ = ["install", "installed", "hooked_environ", "PACKAGE", "MODULE", "HOOK_DIR"]

PACKAGE = "fastdeploy.inter_communicator"
MODULE = "fastdeploy.inter_communicator.engine_worker_queue"
_NAME = "EngineWorkerQueue"
HOOK_DIR = fdsync_spawn_check.HOOK_DIR
_lock = threading.Lock()
_originals: list = []  # FastDeploy's classes replaced so far (to find their aliases)


def _replace(module) -> None:
    """Put the drop-in in ``module`` (FastDeploy's package or module) in place of
    FastDeploy's class; remember the original."""
    from .queue import EngineWorkerQueue

    current = getattr(module, _NAME, None)
    if current is not None and current is not EngineWorkerQueue:
        if current not in _originals:
            _originals.append(current)
    setattr(module, _NAME, EngineWorkerQueue)
    if current is not EngineWorkerQueue:
        took_dropin()


def _patch_aliases() -> None:
    """Modules of FastDeploy that bound the original class already (any name, e.g.
    ``TaskQueue``) get the drop-in."""
    from .queue import EngineWorkerQueue

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fastdeploy" or name.startswith("fastdeploy.")):
            continue
        for attr, value in list(vars(module).items()):
            if any(value is original for original in _originals):
                setattr(module, attr, EngineWorkerQueue)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds PACKAGE and MODULE through the other finders; the swap runs once each has."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in (PACKAGE, MODULE):
            return None
        return fdsync_spawn_check.find_spec_then(fullname, path, target, self, _replace)


def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install(subprocesses: bool = True) -> None:
    """Make FastDeploy's ``EngineWorkerQueue`` the drop-in, in this process and (with
    ``subprocesses``) in every Python process started from it afterwards. Call it before
    FastDeploy starts (before its engine is built: e.g. first thing in the launcher, or
    wrap the launch: ``python -c "from fastdeploy_sync.fastdeploy import install;
    install(); import runpy; runpy.run_module('fastdeploy.entrypoints...', ...)"``).
    Modules that imported FastDeploy's class before are patched as well; an object already
    built from it stays FastDeploy's. Idempotent; never imports FastDeploy; never blocks.

    ``subprocesses``: puts this package's ``subprocess_hook`` directory first on
    ``PYTHONPATH`` in ``os.environ`` (processes inherit it), whose ``sitecustomize`` calls
    ``install()`` at their start and then runs any ``sitecustomize`` it shadows; and warns
    on stderr of each Python child started from this process that would lose it
    (``subprocess_hook.fdsync_spawn_check``). ``fastdeploy-sync run -- COMMAND`` does all of
    it for a command without changing it (``run``)."""
    with _lock:
        if not installed():
            sys.meta_path.insert(0, _Finder())
        for name in (MODULE, PACKAGE):  # imported already: swap now
            module = sys.modules.get(name)
            if module is not None:
                _replace(module)
        _patch_aliases()
        if subprocesses:
            os.environ["PYTHONPATH"] = hooked_environ(os.environ)["PYTHONPATH"]
            fdsync_spawn_check.arm()


def hooked_environ(env) -> dict:
    """A copy of ``env`` whose ``PYTHONPATH`` starts with ``HOOK_DIR`` (the rest kept, in
    order; the hook runs any ``sitecustomize`` it shadows)."""
    env = dict(env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.abspath(p) != HOOK_DIR]
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR] + paths)
    return env
