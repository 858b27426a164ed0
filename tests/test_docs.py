"""The documentation: the MkDocs site builds in strict mode (a broken link or anchor fails),
and the README stays a page a newcomer reads to the end."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 250


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "operating" / "index.html").is_file()


def test_mkdocs_strict_catches_a_broken_link(tmp_path):
    """The check above can fail: the same configuration over a copy of docs/ with one
    link to a missing anchor is refused."""
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(os.path.join(ROOT, "docs"), docs)
    with open(docs / "index.md", "a", encoding="utf-8") as f:
        f.write("\n[broken](design.md#no-such-anchor)\n")
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "-f", str(tmp_path / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "no-such-anchor" in out.stdout + out.stderr


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
