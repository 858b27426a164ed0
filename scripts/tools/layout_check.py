"""Check the package's layout from its source (``ast``, nothing is imported or run).

    python scripts/tools/layout_check.py [--sizes N]

Prints, and exits 1 when any of the first three is not empty:

  * imports that run back up: a module imports one of a layer above its own (``LAYERS``);
    within one package, modules may import each other as long as there is no circle;
  * import circles between modules (imports inside functions count: a lazy import is
    still an edge);
  * private members reached from another module: ``obj._name`` where ``_name`` is not
    defined in the module that reads it (a class's own ``self._x`` and a module's own
    ``_helpers`` are that module's), and ``from x import _name``;
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


def sizes(mods, count):
    rows = []
    for module, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                rows.append((node.end_lineno - node.lineno + 1, kind, f"{module}.{node.name}"))
    rows.sort(reverse=True)
    classes = [r for r in rows if r[1] == "class"][:count]
    functions = [r for r in rows if r[1] == "def"][:count]
    return classes, functions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, default=0, metavar="N",
                    help="also list the N largest classes and functions")
    args = ap.parse_args(argv)
    mods = modules()
    graph = imports(mods)
    up, circ, priv = upward(graph), circles(graph), private_reaches(mods)
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
    if args.sizes:
        classes, functions = sizes(mods, args.sizes)
        print("largest classes:")
        for n, _, where in classes:
            print(f"  {n:5d}  {where}")
        print("largest functions:")
        for n, _, where in functions:
            print(f"  {n:5d}  {where}")
    return 1 if up or circ or priv else 0


if __name__ == "__main__":
    sys.exit(main())
