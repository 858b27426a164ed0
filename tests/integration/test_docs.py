"""The documentation: the MkDocs site builds in strict mode (a broken link or anchor fails),
and the README stays a page a newcomer reads to the end."""

import os
import subprocess
import sys

from conftest import ROOT  # noqa: E402


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
