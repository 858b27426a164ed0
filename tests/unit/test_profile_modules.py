"""The profiler's modules import one way (no circle), read from their source."""

import ast
import os

from conftest import ROOT  # noqa: E402

PACKAGE = os.path.join(ROOT, "fastdeploy_sync", "profiling")


def _imports(path):
    """The profiling modules ``path`` imports (relative imports, at any depth of the file:
    a lazy import inside a function is still an edge)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def test_the_profiling_modules_import_without_a_circle():
    modules = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
    graph = {m: _imports(os.path.join(PACKAGE, m + ".py")) & modules for m in modules}
    done, path = set(), []

    def visit(m):
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert graph["plot"] and "plot" not in graph["report"]
