"""The profile's ``gpu`` step without a GPU: the decode step's code on the CPU (paddle,
and torch where installed), its plumbing through a backend whose device work is CPU work
(``tests/fake_gpu.py``, injected as ``--gpu-backend fake_gpu:BACKEND``), and the one-line
refusal where no GPU is there. CI never needs a GPU."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT  # noqa: E402

HAS_PADDLE = importlib.util.find_spec("paddle") is not None


@pytest.mark.skipif(not HAS_PADDLE, reason="paddlepaddle is not installed")
def test_paddle_decode_step_runs_on_the_cpu():
    code = ("from fastdeploy_sync.profiling import gpu_step\n"
            "from tests.unit.test_profile_gpu_units import TINY, _decode_step_checks\n"
            "paddle = gpu_step._import_paddle()\n"
            "_decode_step_checks(gpu_step.PaddleDecode(paddle, 'cpu', TINY, 'float32'),"
            " lambda a: a)\n"
            "print('ok')\n")
    # its own process: paddle's import costs this test process seconds and memory
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_step_gpu_without_a_gpu_is_one_line_and_exit_status_2():
    """Every framework says why it cannot run, in one line; nothing starts. (Its own
    process: asking paddle imports it.)"""
    out = subprocess.run([sys.executable, "-m", "fastdeploy_sync.cli", "profile",
                          "--no-progress", "--step", "python,gpu", "--mode", "async",
                          "--steps", "10", "--rounds", "1", "--idle-steps", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    if out.returncode != 2 and "no GPU" not in out.stderr:
        pytest.skip("a GPU is here: the refusal cannot be shown")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastdeploy-sync profile: --step gpu: "
                                                    "no GPU to run the gpu step on"), lines
    assert out.stdout == ""


def test_python_and_gpu_steps_through_the_runner_and_the_report():
    """``--step python,gpu`` end to end with the fake backend: every rank calibrates on its
    own device (round-robin), every batch reaches every rank, and the report's regime says
    where each step kind ran; the headline has both kinds."""
    from fastdeploy_sync.profiling import report, terminal
    from fastdeploy_sync.profiling.options import ProfileOptions
    from fastdeploy_sync.profiling.runner import run_profile

    options = ProfileOptions(mode="async", step_kinds=["python", "gpu"], steps=20, rounds=1,
                             idle_steps=0, batch=4, gpu_backend="fake_gpu:BACKEND")
    raw = run_profile(options)
    devices = [c["device"] for c in raw["calibration"]["gpu"]]
    assert devices == ["fake:0 (CPU stand-in)", "fake:1 (CPU stand-in)"]
    assert [c["device"] for c in raw["calibration"]["python"]] == [None, None]
    summary = report.summarize(raw)
    assert summary["correct"] is True
    steps = summary["regime"]["model_step"]
    assert steps["gpu"] == {"on": "GPU", "devices": devices}
    assert steps["python"]["on"] == "CPU"
    line = summary["regime"]["line"]
    assert "python on the CPU" in line and "gpu on a GPU: fake:0 (CPU stand-in) (rank 0)" in line
    assert set(summary["headline"]) == {"python", "gpu"}
    assert "== gpu step: launches a decode step's kernels" in terminal.format_table(summary)
    assert np.isfinite(summary["step_kinds"]["gpu"]["modes"]["async"]["step_ms"]["mean_ms"])
