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

from fastdeploy_sync.profiling import gpu_step
from fastdeploy_sync.profiling.gpu_step import DecodeShape, GpuUnavailable, resolve
from fastdeploy_sync.profiling.workload import ModelStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = DecodeShape(layers=2, hidden=32, heads=4, batch=4, kv_len=8, vocab=50)
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_PADDLE = importlib.util.find_spec("paddle") is not None


def _decode_step_checks(decode, to_numpy):
    """Three layers (cycling through two weight sets) and the end of step, twice: the
    token ids come back to the host, one per sequence, within the vocabulary, and a step
    starts from the same state (the same ids for the same step)."""
    layer, finish = decode.step_parts()
    ids = []
    for _ in range(2):
        for _ in range(3):
            layer()
        ids.append(to_numpy(finish()))
    assert ids[0].shape == (TINY.batch,)
    assert ((0 <= ids[0]) & (ids[0] < TINY.vocab)).all()
    assert (ids[0] == ids[1]).all()
    assert decode.next == 0  # the end of step rewinds to the first layer


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (its CPU build runs this; "
                                          "the fake-backend tests below need neither)")
def test_torch_decode_step_runs_on_the_cpu():
    import torch

    decode = gpu_step.TorchDecode(torch, "cpu", TINY, torch.float32)
    _decode_step_checks(decode, lambda t: t.numpy())


@pytest.mark.skipif(not HAS_PADDLE, reason="paddlepaddle is not installed")
def test_paddle_decode_step_runs_on_the_cpu():
    code = ("from fastdeploy_sync.profiling import gpu_step\n"
            "from tests.test_profile_gpu_step import TINY, _decode_step_checks\n"
            "paddle = gpu_step._import_paddle()\n"
            "_decode_step_checks(gpu_step.PaddleDecode(paddle, 'cpu', TINY, 'float32'),"
            " lambda a: a)\n"
            "print('ok')\n")
    # its own process: paddle's import costs this test process seconds and memory
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_step_is_units_layers_and_one_end_on_the_rank_s_device():
    """Rank 3 of a run on two devices runs on device 1; after calibration a step is
    ``units`` layers and exactly one end of step (the head and the host's wait)."""
    import fake_gpu

    backend = fake_gpu.FakeBackend(devices=2)
    fake_gpu.ROUND_ROBIN = backend
    try:
        step = ModelStep("gpu", 2.0, rank=3, gpu_backend="fake_gpu:ROUND_ROBIN")
        assert backend.built_on == [1] and step.device == "fake:1 (CPU stand-in)"
        calibration = step.calibrate()
        assert calibration["device"] == step.device and calibration["units"] >= 1
        assert calibration["fixed_us"] >= 0 and calibration["unit_us"] > 0
        layers, finishes = backend.layers, backend.finishes
        for _ in range(3):
            step()
        assert backend.finishes - finishes == 3
        assert backend.layers - layers == 3 * step.units
    finally:
        del fake_gpu.ROUND_ROBIN


def test_backend_choice_and_its_errors():
    import fake_gpu

    assert resolve("fake_gpu:BACKEND") is fake_gpu.BACKEND
    with pytest.raises(GpuUnavailable, match="the fake sees no GPU"):
        resolve("fake_gpu:NO_GPU")
    with pytest.raises(ValueError, match="cannot import it"):
        resolve("no_such_module_here:BACKEND")
    with pytest.raises(ValueError, match="expected auto, paddle, torch or MODULE:ATTR"):
        resolve("cuda")


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
