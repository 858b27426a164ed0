"""The README and the documented environment variables, read as text."""

import os

from conftest import ROOT  # noqa: E402

README_MAX_LINES = 250


def test_readme_is_at_most_250_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_to_existing_docs_pages():
    """README links into docs/ are plain relative paths (GitHub renders them; mkdocs does
    not see README): every one must name a page that exists."""
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    targets = {m.split("#")[0] for m in re.findall(r"\]\((docs/[^)\s]+)\)", readme)}
    assert targets, "README links to no docs page"
    missing = [t for t in sorted(targets) if not os.path.isfile(os.path.join(ROOT, t))]
    assert not missing, missing


def test_every_environment_variable_is_documented():
    """docs/operating.md's table lists every FD_SYNC_* variable the code reads."""
    import re

    names = set()
    for d, _, files in os.walk(os.path.join(ROOT, "fastdeploy_sync")):
        for fn in files:
            if fn.endswith(".py"):
                with open(os.path.join(d, fn), encoding="utf-8") as f:
                    names.update(re.findall(r"\bFD_SYNC_[A-Z0-9_]*[A-Z0-9]\b", f.read()))
    with open(os.path.join(ROOT, "docs", "operating.md"), encoding="utf-8") as f:
        table = {m for m in re.findall(r"^\| `(FD_SYNC_[A-Z0-9_]+)`", f.read(), re.M)}
    assert names, "found no FD_SYNC_ variable in the code"
    assert names <= table, sorted(names - table)
