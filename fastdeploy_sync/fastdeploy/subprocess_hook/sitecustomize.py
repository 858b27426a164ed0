"""Run at interpreter start in processes started after ``fastdeploy_sync.fastdeploy.install()``
or under ``fastdeploy-sync run`` (its directory is on ``PYTHONPATH``). Costs nothing until
FastDeploy's queue module is imported: only then is ``install()`` loaded and run, which swaps
in the drop-in as it does in the process that called it. Arms the check on the children this
process starts (``fdsync_spawn_check``: ``os.exec*`` now, ``subprocess`` and
``multiprocessing`` when they are imported). Then runs the ``sitecustomize`` this one
shadows, if any."""

import importlib.util
import os
import sys

import fdsync_spawn_check

_TARGETS = ("fastdeploy.inter_communicator", "fastdeploy.inter_communicator.engine_worker_queue")


class _Deferred:
    """Until FastDeploy's queue is imported: then ``install()``, whose finder takes over.
    Until ``subprocess``/``multiprocessing.util`` are imported: then they are armed."""

    def __init__(self):
        self._waiting = set(fdsync_spawn_check.ARMED_MODULES) - set(sys.modules)
        self._fastdeploy = True

    def _done(self, fullname):
        self._waiting.discard(fullname)
        if not self._waiting and not self._fastdeploy and self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path, target=None):
        if fullname in self._waiting:
            self._done(fullname)
            return self._armed(fullname, path, target)
        if not self._fastdeploy or fullname not in _TARGETS:
            return None
        self._fastdeploy = False
        self._done(fullname)
        try:
            from fastdeploy_sync.fastdeploy.install import install
        except Exception as exc:  # never break FastDeploy's import: it keeps its own queue
            print(f"fastdeploy_sync: pid {os.getpid()}: the FastDeploy drop-in is NOT installed "
                  f"in this process, FastDeploy's EngineWorkerQueue stays ({exc})",
                  file=sys.stderr)
            return None
        install()
        for finder in sys.meta_path:  # the finder install() put first: it wraps the loader
            if finder.__class__.__module__ == "fastdeploy_sync.fastdeploy.install":
                return finder.find_spec(fullname, path, target)
        return None

    def _armed(self, fullname, path, target):
        return fdsync_spawn_check.find_spec_then(fullname, path, target, self,
                                                 fdsync_spawn_check.arm_module)


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_fdsync_shadowed_sitecustomize",
                                                          candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


fdsync_spawn_check.arm()
sys.meta_path.insert(0, _Deferred())
_chain()
