"""The gpu step kind's units, layers and backend choice (a fake backend; torch on the CPU when it is installed)."""

import importlib.util

import pytest

from fastdeploy_sync.profiling import gpu_step
from fastdeploy_sync.profiling.gpu_step import DecodeShape, GpuUnavailable, resolve
from fastdeploy_sync.profiling.workload import ModelStep

TINY = DecodeShape(layers=2, hidden=32, heads=4, batch=4, kv_len=8, vocab=50)


HAS_TORCH = importlib.util.find_spec("torch") is not None


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
    with pytest.raises(ValueError, match="expected auto, paddle, torch, cpu-standin or MODULE:ATTR"):
        resolve("cuda")
