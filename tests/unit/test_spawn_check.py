"""Which child commands would start Python without the drop-in's hook
(``subprocess_hook.fdsync_spawn_check.lost_hook``): read from the command alone, nothing run."""

import os
import sys

import pytest

from fastdeploy_sync.fastdeploy.subprocess_hook.fdsync_spawn_check import HOOK_DIR, lost_hook

HOOKED = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": HOOK_DIR + os.pathsep + "/x"}


@pytest.mark.parametrize("args", [
    [sys.executable, "-c", "pass"],
    ["python3", "-u", "-X", "dev", "-m", "fastdeploy.worker"],
    ["python3", "-c", "-S"],  # -S after -c is the code's argument
    ["python3", "script.py", "-S"],
    ["sh", "-c", "python3 x"],
    ["nvidia-smi"],
])
def test_keeps_the_hook_or_is_no_python(args):
    assert lost_hook(args, HOOKED) is None


@pytest.mark.parametrize("args,why", [
    (["python3", "-S", "x.py"], "-S"),
    (["python3.11", "-I", "-c", "1"], "-I"),
    (["python", "-uE", "x.py"], "-E"),
    ([sys.executable, "-X", "dev", "-S", "x.py"], "-S"),
])
def test_options_that_lose_it(args, why):
    assert why in lost_hook(args, HOOKED)


def test_environments_that_lose_it(tmp_path):
    assert "no PYTHONPATH" in lost_hook(["python3", "x.py"], {"PATH": "/bin"})
    assert "does not hold" in lost_hook(["python3", "x.py"], {"PYTHONPATH": "/x"})
    (tmp_path / "sitecustomize.py").write_text("")
    shadow = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{HOOK_DIR}"}
    assert "sitecustomize.py of its own" in lost_hook(["python3", "x.py"], shadow)
    plain = {"PYTHONPATH": f"{tmp_path.parent}{os.pathsep}{HOOK_DIR}"}  # no sitecustomize
    assert lost_hook(["python3", "x.py"], plain) is None


@pytest.mark.parametrize("line,lost", [
    ("python3 -m paddle.distributed.launch --gpus 0,1 worker.py --x 1", None),
    ("cd /tmp && FLAGS_x=1 python3 worker.py > log 2>&1", None),
    ("PYTHONPATH=/elsewhere python3 worker.py", "does not hold"),
    ("PYTHONPATH=/elsewhere:$PYTHONPATH python3 worker.py", None),
    ("export PYTHONPATH=/elsewhere; nohup python3 worker.py &", "does not hold"),
    ("env -i PATH=/bin python3 worker.py", "no PYTHONPATH"),
    ("env -u PYTHONPATH python3 worker.py", "no PYTHONPATH"),
    ("echo start; exec python3 -I worker.py", "-I"),
    ("ls | grep x", None),
])
def test_shell_lines(line, lost):
    problem = lost_hook(line, HOOKED, shell=True)
    assert (problem is None) if lost is None else (lost in problem), problem


def test_a_script_whose_interpreter_line_drops_site(tmp_path):
    script = tmp_path / "tool"
    script.write_text("#!/usr/bin/env -S python3 -S\nprint(1)\n")
    script.chmod(0o755)
    assert "-S" in lost_hook([str(script)], HOOKED)
    script.write_text("#!/usr/bin/env python3\nprint(1)\n")
    assert lost_hook([str(script)], HOOKED) is None
    on_path = dict(HOOKED, PATH=str(tmp_path))
    assert "no PYTHONPATH" in lost_hook(["tool"], {"PATH": str(tmp_path)})
    assert lost_hook(["tool"], on_path) is None
    binary = tmp_path / "binary"
    binary.write_bytes(b"\x7fELF" + bytes(300))
    binary.chmod(0o755)
    assert lost_hook([str(binary)], {}) is None


def test_a_shell_given_a_line_is_read_as_a_shell_line():
    assert "-S" in lost_hook(["bash", "-c", "cd /w && python3 -S x.py"], HOOKED)
    assert "-I" in lost_hook(["/bin/sh", "-e", "-c", "exec python3 -I x.py"], HOOKED)
    assert "-E" in lost_hook(["bash", "-lc", "python3 -E x.py"], HOOKED)
    assert lost_hook(["bash", "-c", "python3 x.py"], HOOKED) is None
    # -c after the script is the script's argument, not the shell's
    assert lost_hook(["sh", "script.sh", "-c", "python3 -S x.py"], HOOKED) is None
