"""What the package carries besides its modules, and the type checking of its public API:
run against an installed copy (not the checkout) these check what the build shipped."""

import os

import pytest

import fastdeploy_sync
from conftest import ROOT
from fastdeploy_sync.fastdeploy import EngineWorkerQueue, subprocess_hook


def test_the_package_is_marked_typed():
    """PEP 561: without py.typed a type checker ignores the package's annotations."""
    assert os.path.isfile(os.path.join(os.path.dirname(fastdeploy_sync.__file__), "py.typed"))


def test_the_subprocess_hook_files_ship():
    """``fastdeploy-sync run`` puts this directory on PYTHONPATH by path: its files must be
    there, not only importable from a checkout."""
    names = set(os.listdir(os.path.dirname(subprocess_hook.__file__)))
    assert {"sitecustomize.py", "fdsync_spawn_check.py"} <= names, sorted(names)


def test_every_public_module_is_checked_with_no_untyped_def():
    """The modules that define what ``fastdeploy_sync`` exports, and the drop-in's
    ``EngineWorkerQueue``, are in pyproject.toml's mypy override that disallows untyped
    and partly typed defs: a new public module is not left out of it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        mypy = tomllib.load(f)["tool"]["mypy"]
    strict = set()
    for override in mypy["overrides"]:
        if override.get("disallow_untyped_defs") and override.get("disallow_incomplete_defs"):
            strict.update(override["module"])
    public = {"fastdeploy_sync", EngineWorkerQueue.__module__}
    for export in fastdeploy_sync.__all__:
        module = getattr(getattr(fastdeploy_sync, export), "__module__", None)
        if module is not None:
            public.add(module)
    assert public <= strict, sorted(public - strict)
