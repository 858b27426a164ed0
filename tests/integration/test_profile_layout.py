"""The profiler stays out of the library: ``import fastdeploy_sync`` (and the CLI's other
commands) load none of it, nor tqdm or matplotlib; its modules import one way (no circle);
without the ``profile`` extra the profile still runs, and ``--plot`` says in one line what
to install."""

import json
import os
import subprocess
import sys

from conftest import ROOT  # noqa: E402

HEAVY = ("tqdm", "matplotlib", "paddle", "torch")


def _modules_after(code):
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_fastdeploy_sync_loads_no_profiler_tqdm_or_matplotlib():
    loaded = _modules_after("import fastdeploy_sync")
    assert not [m for m in loaded if m.startswith("fastdeploy_sync.profiling")]
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_the_cli_parser_loads_only_the_profile_options():
    """Building ``fastdeploy-sync``'s parser (what ``status`` and ``clean`` do) loads the
    profile command's parser and options, never its runner, loops, report or plot."""
    loaded = _modules_after("import fastdeploy_sync.cli as c\nc.build_parser()")
    profiling = {m for m in loaded if m.startswith("fastdeploy_sync.profiling")}
    assert profiling <= {"fastdeploy_sync.profiling", "fastdeploy_sync.profiling.command",
                         "fastdeploy_sync.profiling.options"}, sorted(profiling)
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_the_profile_runs_without_the_extra_and_plot_says_what_to_install(tmp_path):
    """tqdm and matplotlib made unimportable: the run still prints its report and writes its
    JSON; --plot is refused in one line naming the extra, and the exit status says so."""
    blocked = tmp_path / "blocked"
    for module in ("tqdm", "matplotlib"):
        (blocked / module).mkdir(parents=True)
        (blocked / module / "__init__.py").write_text(
            f"raise ImportError('{module} is blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), ROOT]))
    json_path, png_path = tmp_path / "p.json", tmp_path / "p.png"
    out = subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "profile", "--mode",
                          "sync", "--tp", "1", "--step", "python", "--steps", "20", "--rounds",
                          "1", "--idle-steps", "0", "--batch", "4", "--json", str(json_path),
                          "--plot", str(png_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 2, out.stdout + out.stderr
    assert json.loads(json_path.read_text())["correct"] is True
    assert not png_path.exists()
    assert "whole cost per step" in out.stdout and "definitions:" in out.stdout
    said = [line for line in out.stderr.splitlines() if "--plot" in line]
    assert said and all("pip install 'fastdeploy_sync[profile]'" in line for line in said)
    assert any("no progress bar: tqdm is not installed" in line for line in
               out.stderr.splitlines())
    assert "Traceback" not in out.stderr
