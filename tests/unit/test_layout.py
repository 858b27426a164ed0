"""The package's layout, read from its source (scripts/tools/layout_check.py): no import runs
back up a layer, no import circle, no module reaches into another's private members, and
no class grows past its reviewed size budget."""

import importlib.util
import os

from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    "layout_check", os.path.join(ROOT, "scripts", "tools", "layout_check.py"))
layout_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_check)

def test_no_import_runs_back_up_and_there_is_no_circle():
    mods = layout_check.modules(ROOT)
    graph = layout_check.imports(mods)
    assert layout_check.upward(graph) == []
    assert layout_check.circles(graph) == []


def test_no_module_reaches_into_another_modules_private_members():
    assert layout_check.private_reaches(layout_check.modules(ROOT)) == []


def test_no_class_grows_past_its_reviewed_budget():
    """400 lines for a class (docstrings included), or the budget reviewed for it in
    layout_check.CLASS_BUDGETS; no budget outlives its class."""
    faults = layout_check.budget_faults(layout_check.over_budget(layout_check.modules(ROOT)))
    assert faults == [], "\n".join(faults)


def test_the_budget_check_names_the_budget_to_review(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(9))  # a class of 10 lines
    _write(tmp_path, "fastdeploy_sync/__init__.py", "")
    _write(tmp_path, "fastdeploy_sync/a.py", f"class Big:\n{body}\n\nclass Small:\n    y = 1\n")
    _write(tmp_path, "fastdeploy_sync/b.py", f"class Kept:\n{body}")
    mods = layout_check.modules(str(tmp_path))
    budgets = {"fastdeploy_sync.b.Kept": 10, "fastdeploy_sync.c.Gone": 20}
    over = layout_check.over_budget(mods, budgets, default=9, floor=5)
    assert over == [("fastdeploy_sync.a.Big", 10, 9), ("fastdeploy_sync.c.Gone", None, 20)]
    big, gone = layout_check.budget_faults(over)
    assert "fastdeploy_sync.a.Big: 10 lines, past its budget of 9" in big
    assert "CLASS_BUDGETS in scripts/tools/layout_check.py" in big
    assert gone.startswith("fastdeploy_sync.c.Gone: gone or renamed")
    # a reviewed budget at its size passes
    assert layout_check.over_budget(mods, {"fastdeploy_sync.a.Big": 10, "fastdeploy_sync.b.Kept": 10},
                                    default=9, floor=5) == []
    # a budget whose class shrank back under the floor is stale: the entry must go
    shrunk = layout_check.over_budget(mods, {"fastdeploy_sync.b.Kept": 30}, default=20, floor=11)
    assert shrunk == [("fastdeploy_sync.b.Kept", 10, 30)]
    (stale,) = layout_check.budget_faults(shrunk)
    assert stale.startswith("fastdeploy_sync.b.Kept: 10 lines, back under")
    assert "remove its budget entry" in stale


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checks_find_each_kind_of_fault(tmp_path):
    """The checks can fail: a tree with an upward import, a circle and a private reach."""
    _write(tmp_path, "fastdeploy_sync/__init__.py", "")
    _write(tmp_path, "fastdeploy_sync/errors.py", "from .wire import codec\n")  # upward
    _write(tmp_path, "fastdeploy_sync/wire/__init__.py", "")
    _write(tmp_path, "fastdeploy_sync/wire/codec.py",
           "from . import auth\n\n\ndef f(x):\n    return x._secret\n")  # circle, private
    _write(tmp_path, "fastdeploy_sync/wire/auth.py", "from .codec import f\n")
    mods = layout_check.modules(str(tmp_path))
    graph = layout_check.imports(mods)
    assert ("fastdeploy_sync.errors", "fastdeploy_sync.wire.codec") in layout_check.upward(graph)
    assert any(set(c) == {"fastdeploy_sync.wire.codec", "fastdeploy_sync.wire.auth"}
               for c in layout_check.circles(graph))
    assert [(m, what) for m, _, what in layout_check.private_reaches(mods)] == [
        ("fastdeploy_sync.wire.codec", "._secret")]


def test_each_package_docstring_lists_every_module_it_holds():
    """A reader starts at a package's ``__init__``: it names each of its modules (as
    ``module``), so a module added or moved without a line there fails here."""
    import ast

    for package in ("shm", "tp", "engine", "worker", "profiling", "testing"):
        base = os.path.join(ROOT, "fastdeploy_sync", package)
        doc = ast.get_docstring(ast.parse(open(os.path.join(base, "__init__.py")).read()))
        held = {f[:-3] for f in os.listdir(base) if f.endswith(".py") and f != "__init__.py"}
        missing = sorted(m for m in held if f"``{m}``" not in doc)
        assert not missing, f"fastdeploy_sync/{package}/__init__.py does not list {missing}"


def test_the_library_never_imports_its_testing_package():
    graph = layout_check.imports(layout_check.modules(ROOT))
    testing = layout_check.PACKAGE + ".testing"
    assert [(a, b) for a, targets in graph.items() for b in targets
            if b.startswith(testing) and not a.startswith(testing)] == []


def test_the_profile_benchmark_uses_only_what_the_library_exports():
    assert layout_check.non_public_uses(layout_check.modules(ROOT)) == []


def test_scripts_reach_no_private_member_and_no_test_module():
    """What scripts and tests share is ``fastdeploy_sync.testing``; only the declared
    white-box benchmarks reach private members, and their docstrings say so."""
    assert layout_check.script_faults(layout_check.scripts(ROOT)) == []


def test_the_public_and_script_checks_find_each_kind_of_fault(tmp_path):
    _write(tmp_path, "fastdeploy_sync/__init__.py", '__all__ = ["TaskQueue"]\n')
    _write(tmp_path, "fastdeploy_sync/cleanup.py", '__all__ = ["scan"]\n')
    _write(tmp_path, "fastdeploy_sync/tp/__init__.py", '__all__ = ["ShmBarrier"]\n')
    _write(tmp_path, "fastdeploy_sync/profiling/__init__.py", "")
    _write(tmp_path, "fastdeploy_sync/profiling/loops.py",
           "from ..tp import ShmBarrier\nfrom ..cleanup import scan\n"
           "from ..tp.shm_group import ShmTPGroup\n")
    mods = layout_check.modules(str(tmp_path))
    assert [(m, what) for m, _, what in layout_check.non_public_uses(mods, str(tmp_path))] == [
        ("fastdeploy_sync.profiling.loops", "fastdeploy_sync.tp.shm_group.ShmTPGroup")]
    _write(tmp_path, "tests/workers.py", "")
    _write(tmp_path, "scripts/tools/a.py",
           'import os, sys\nsys.path.insert(0, os.path.join("..", "tests"))\n'
           "from workers import collect\n\n\ndef f(client):\n    return client._ring\n")
    _write(tmp_path, "scripts/benchmarks/ring_parts.py", '"""Times parts."""\n')
    found = layout_check.script_faults(layout_check.scripts(str(tmp_path)), str(tmp_path))
    assert [(rel, what) for rel, _, what in found] == [
        ("scripts/benchmarks/ring_parts.py", 'docstring does not say "White-box benchmark"'),
        ("scripts/tools/a.py", "edits sys.path to reach tests/"),
        ("scripts/tools/a.py", "imports workers (tests/)"),
        ("scripts/tools/a.py", "._ring")]
