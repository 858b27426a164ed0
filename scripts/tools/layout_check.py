"""Check the package's layout from its source (``ast``, nothing is imported or run).

    python scripts/tools/layout_check.py [--sizes N]

Prints, and exits 1 when any but the last is not empty:

  * imports that run back up: a module imports one of a layer above its own (``LAYERS``);
    within one package, modules may import each other as long as there is no circle;
  * import circles between modules (imports inside functions count: a lazy import is
    still an edge);
  * private members reached from another module: ``obj._name`` where ``_name`` is not
    defined in the module that reads it (a class's own ``self._x`` and a module's own
    ``_helpers`` are that module's), and ``from x import _name``; in the package and in
    ``scripts/``, except the white-box benchmarks (``WHITE_BOX``), whose docstrings say so;
  * the ``profile`` benchmark (``PUBLIC_ONLY``) using what the library does not export to
    its users (``public_names``);
  * scripts that reach the tests: an import of a module of ``tests/``, or a ``sys.path``
    edit that names it (what scripts and tests share is ``fastdeploy_sync.testing``);
  * classes past their size budget (lines, docstrings included): ``CLASS_LINES`` for
    every class, or its reviewed entry in ``CLASS_BUDGETS``; and entries of that table
    that name no class any more;
  * with ``--sizes N``: the N largest classes and functions (lines, docstrings included).

``tests/unit/test_layout.py`` runs the same checks.
"""

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "fastdeploy_sync"

# Layers, bottom-up: a module may import its own package and the layers below its own.
LAYERS = (
    ("errors", "envs", "logs", "names", "version"),
    ("wire",),
    ("shm",),
    ("forks", "status_client"),
    ("tp",),
    ("engine", "worker", "cleanup"),
    ("fastdeploy", "profiling", "metrics"),
    ("cli", "__init__", "testing"),
)


# What the library exports to its users: the package's ``__all__``, each subpackage's
# (its ``__init__``'s) and these modules' (documented entry points: docs/operating.md).
PUBLIC_MODULES = ("cleanup",)
# Packages that use the library only as its users can: the ``profile`` benchmark.
PUBLIC_ONLY = ("profiling",)
# Their one exception, (module, what it imports from): the FastDeploy stand-in's flags
# segment needs an owner lock that outlives a killed server (its leftovers are removed,
# a live server's never), which is ``shm.segment``'s; exporting that, or copying it into a
# benchmark, would be worse.
PUBLIC_ONLY_EXCEPTIONS = (("fastdeploy_sync.profiling.fd_baseline", "fastdeploy_sync.shm.segment"),)
# Scripts that time the library's own parts by wrapping them (a public hook would put
# work on the step's path for every user): each says "White-box benchmark" in its
# docstring, and only these may reach private members.
WHITE_BOX = ("scripts/benchmarks/bench_sync.py", "scripts/benchmarks/ring_parts.py",
             "scripts/benchmarks/bench_idle.py")

# "No class over ~400 lines" (docstrings included): the budget of every class but those
# below.
CLASS_LINES = 400
# Reviewed budgets of the classes over 300 lines: each its size when reviewed, rounded up
# a little. A class that grows past its budget fails the check: split it, or review the
# growth and raise its entry here (and drop an entry once its class is back under 300).
BUDGET_FLOOR = 300
CLASS_BUDGETS = {
    "fastdeploy_sync.worker.client.TaskClient": 450,
    "fastdeploy_sync.fastdeploy.queue.EngineWorkerQueue": 440,
    "fastdeploy_sync.tp.shm_group.ShmTPGroup": 430,
    "fastdeploy_sync.profiling.fd_baseline.FDManagerQueue": 380,
    "fastdeploy_sync.engine.queue.TaskQueue": 370,
    "fastdeploy_sync.engine.ledger.Ledger": 340,
}


def unit_of(module: str) -> str:
    """The top-level unit (package or module) ``fastdeploy_sync.X...`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    unit = unit_of(module)
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(f"{module}: its unit {unit!r} is in no layer")


def modules(root=ROOT):
    """``{module name: path}`` of every module of the package."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for d, _, files in os.walk(base):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(d, fn)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _resolve(module, is_package, node):
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods):
    """``{module: {imported module, ...}}`` within the package."""
    graph = {}
    for module, path in mods.items():
        is_package = path.endswith("__init__.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_package, node)
                if not target.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE):
                        edges.add(alias.name)
        edges.discard(module)
        graph[module] = {e for e in edges if e in mods}
    return graph


def upward(graph):
    """``[(importer, imported), ...]`` that run back up (see the module docstring)."""
    bad = []
    for a, targets in graph.items():
        for b in targets:
            if unit_of(a) == unit_of(b):
                continue
            if b == PACKAGE and a.startswith(PACKAGE + "."):
                bad.append((a, b))  # a submodule importing the package root
            elif layer_of(b) >= layer_of(a):
                bad.append((a, b))
    return sorted(bad)


def circles(graph):
    """Every import circle found (each as a list of modules, first repeated last)."""
    found, done, path = [], set(), []

    def visit(m):
        if m in path:
            found.append(path[path.index(m):] + [m])
            return
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            # a package's __init__ importing its own modules is how packages work
            if not (n.startswith(m + ".") and mods_is_package.get(m)):
                visit(n)
        path.pop()
        done.add(m)

    mods_is_package = {m: True for m in graph if any(o.startswith(m + ".") for o in graph)}
    for m in sorted(graph):
        visit(m)
    return found


def private_reaches(mods):
    """``[(module, line, what), ...]``: private members of another module reached."""
    bad = []
    for module, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        own = set()  # private names this module defines (attributes, functions, globals)
        foreign_modules = set()  # names bound to modules outside the package
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if not alias.name.startswith(PACKAGE):
                        foreign_modules.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and not (node.module or "").startswith(PACKAGE):
                    for alias in node.names:
                        foreign_modules.add(alias.asname or alias.name)
                else:
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            bad.append((module, node.lineno, f"imports {alias.name}"))
            elif isinstance(node, ast.Assign):  # __slots__ = ("_a", "_b")
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        for elt in getattr(node.value, "elts", ()):
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                                own.add(elt.value)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign_modules:
                continue  # a library's business (sys._getframe, os._exit...)
            bad.append((module, node.lineno, f".{name}"))
    return sorted(bad)


def _all_of(path, root):
    """The names of a module's ``__all__`` (``*other.__all__`` of a sibling followed)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            for elt in getattr(node.value, "elts", ()):
                if isinstance(elt, ast.Constant):
                    names.add(elt.value)
                elif isinstance(elt, ast.Starred) and isinstance(elt.value, ast.Attribute):
                    sibling = os.path.join(os.path.dirname(path), f"{elt.value.value.id}.py")
                    names |= _all_of(sibling, root)
    return names


def public_names(root=ROOT) -> set:
    """What the library exports to its users (``PUBLIC_MODULES``' comment)."""
    base = os.path.join(root, PACKAGE)
    paths = [os.path.join(base, "__init__.py")]
    paths += [os.path.join(base, d, "__init__.py") for d in sorted(os.listdir(base))
              if os.path.isfile(os.path.join(base, d, "__init__.py"))]
    paths += [os.path.join(base, f"{m}.py") for m in PUBLIC_MODULES]
    names = set()
    for path in paths:
        names |= _all_of(path, root)
    return names


def non_public_uses(mods, root=ROOT):
    """``[(module, line, what), ...]``: a ``PUBLIC_ONLY`` package importing from the
    library (outside itself) a name the library does not export (``public_names``)."""
    public = public_names(root)
    bad = []
    for module, path in mods.items():
        if unit_of(module) not in PUBLIC_ONLY:
            continue
        own = f"{PACKAGE}.{unit_of(module)}"
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.endswith("__init__.py"), node)
                if (target.startswith(PACKAGE) and not target.startswith(own)
                        and (module, target) not in PUBLIC_ONLY_EXCEPTIONS):
                    bad += [(module, node.lineno, f"{target}.{a.name}") for a in node.names
                            if a.name not in public]
            elif isinstance(node, ast.Import):
                bad += [(module, node.lineno, a.name) for a in node.names
                        if a.name.startswith(PACKAGE + ".") and not a.name.startswith(own)]
    return sorted(bad)


def scripts(root=ROOT):
    """``{path relative to root: path}`` of every script under ``scripts/``."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, "scripts")):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(d, fn)
                out[os.path.relpath(path, root)] = path
    return out


def _test_modules(root):
    names = set()
    for _, _, files in os.walk(os.path.join(root, "tests")):
        names |= {fn[:-3] for fn in files if fn.endswith(".py")}
    return names - {"__init__"}


def script_faults(found, root=ROOT):
    """``[(script, line, what), ...]``: private members reached by a script that is not a
    declared white-box benchmark, a white-box benchmark whose docstring does not say so,
    and scripts that reach the tests (module docstring)."""
    tests = _test_modules(root)
    bad = []
    for rel, path in found.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        if rel in WHITE_BOX:
            if "White-box benchmark" not in (ast.get_docstring(tree) or ""):
                bad.append((rel, 1, 'docstring does not say "White-box benchmark"'))
        else:
            bad += [(rel, line, what) for _, line, what in private_reaches({rel: path})]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [(rel, node.lineno, f"imports {a.name} (tests/)") for a in node.names
                        if a.name.split(".")[0] in tests]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] in tests:
                    bad.append((rel, node.lineno, f"imports {node.module} (tests/)"))
            elif isinstance(node, (ast.Expr, ast.Assign)) and _edits_sys_path(node) and any(
                    isinstance(c, ast.Constant) and isinstance(c.value, str)
                    and "tests" in c.value for c in ast.walk(node)):
                bad.append((rel, node.lineno, "edits sys.path to reach tests/"))
    return sorted(bad)


def _edits_sys_path(node) -> bool:
    """``sys.path.insert/append/extend(...)`` or ``sys.path[...] = ...``."""
    for n in ast.walk(node):
        if (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                and n.value.id == "sys"):
            return True
    return False


def sizes(mods, count):
    rows = []
    for module, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                rows.append((node.end_lineno - node.lineno + 1, kind, f"{module}.{node.name}"))
    rows.sort(reverse=True)
    classes = [r for r in rows if r[1] == "class"][:count]  # count None: all of them
    functions = [r for r in rows if r[1] == "def"][:count]
    return classes, functions


def over_budget(mods, budgets=None, default=CLASS_LINES, floor=BUDGET_FLOOR):
    """The classes past their size budget, as (class, lines, budget), largest first; then
    the budgeted classes back under ``floor`` lines (their entry is no longer needed), as
    (class, lines, budget); then the entries of ``budgets`` (``CLASS_BUDGETS`` by default)
    naming no class, as (name, None, budget)."""
    budgets = CLASS_BUDGETS if budgets is None else budgets
    classes, _ = sizes(mods, None)
    found = {where for _, _, where in classes}
    over = [(where, n, budgets.get(where, default)) for n, _, where in classes
            if n > budgets.get(where, default)]
    under = [(where, n, budgets[where]) for n, _, where in classes
             if where in budgets and n < floor]
    return over + under + [(name, None, b) for name, b in sorted(budgets.items())
                           if name not in found]


def budget_faults(over):
    """One line per ``over_budget`` row: what grew (or shrank, or is gone) and what to
    review."""
    where = "CLASS_BUDGETS in scripts/tools/layout_check.py"
    return [f"{name}: gone or renamed; remove or rename its budget entry ({where})"
            if n is None else
            f"{name}: {n} lines, past its budget of {budget}: split it, or review the "
            f"growth and raise its budget ({where})" if n > budget else
            f"{name}: {n} lines, back under {BUDGET_FLOOR}: remove its budget entry ({where})"
            for name, n, budget in over]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, default=0, metavar="N",
                    help="also list the N largest classes and functions")
    args = ap.parse_args(argv)
    mods = modules()
    graph = imports(mods)
    up, circ, priv = upward(graph), circles(graph), private_reaches(mods)
    hidden, script_bad = non_public_uses(mods), script_faults(scripts())
    too_big = budget_faults(over_budget(mods))
    print(f"{len(mods)} modules, {sum(len(v) for v in graph.values())} imports within the "
          f"package")
    print(f"imports that run back up: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    print(f"import circles: {len(circ)}")
    for c in circ:
        print("  " + " -> ".join(c))
    print(f"private members reached from another module: {len(priv)}")
    for module, line, what in priv:
        print(f"  {module}:{line}: {what}")
    print(f"the profile benchmark using what the library does not export: {len(hidden)}")
    for module, line, what in hidden:
        print(f"  {module}:{line}: {what}")
    print(f"scripts reaching private members or the tests: {len(script_bad)}")
    for rel, line, what in script_bad:
        print(f"  {rel}:{line}: {what}")
    print(f"classes past their size budget, or stale budgets: {len(too_big)}")
    for line in too_big:
        print(f"  {line}")
    if args.sizes:
        classes, functions = sizes(mods, args.sizes)
        print("largest classes:")
        for n, _, where in classes:
            print(f"  {n:5d}  {where}")
        print("largest functions:")
        for n, _, where in functions:
            print(f"  {n:5d}  {where}")
    return 1 if up or circ or priv or hidden or script_bad or too_big else 0


if __name__ == "__main__":
    sys.exit(main())
