"""Run at interpreter start in processes started after ``fastdeploy_sync.fastdeploy.install()``
(its directory is on ``PYTHONPATH``). Costs nothing until FastDeploy's queue module is
imported: only then is ``install()`` loaded and run, which swaps in the drop-in as it does
in the process that called it. Then runs the ``sitecustomize`` this one shadows, if any."""

import importlib.util
import os
import sys

_TARGETS = ("fastdeploy.inter_communicator", "fastdeploy.inter_communicator.engine_worker_queue")


class _Deferred:
    """Until FastDeploy's queue is imported: then ``install()``, whose finder takes over."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            from fastdeploy_sync.fastdeploy.install import install
        except Exception as exc:  # never break FastDeploy's import: it keeps its own queue
            print(f"fastdeploy_sync: the FastDeploy drop-in is not installed in this process "
                  f"({exc})", file=sys.stderr)
            return None
        install()
        for finder in sys.meta_path:  # the finder install() put first: it wraps the loader
            if finder.__class__.__module__ == "fastdeploy_sync.fastdeploy.install":
                return finder.find_spec(fullname, path, target)
        return None


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


sys.meta_path.insert(0, _Deferred())
_chain()
