"""A GPU backend for the profile's ``gpu`` step whose device work is CPU work, so that the
step's plumbing (backend choice, round-robin devices, calibration with an end of step,
the runner, the report) is tested without a GPU: ``--gpu-backend fake_gpu:BACKEND``.

``BACKEND`` has two "devices"; a layer is a small numpy matmul, the end of step a
smaller one that returns the argmax, as the real step's head and host wait do. It counts
what ran (per process) so that a test can check a step is ``units`` layers and one end.
"""

import numpy as np


class FakeBackend:
    name = "fake"

    def __init__(self, devices=2, why_not=None):
        self.devices, self.why_not = devices, why_not
        self.layers = self.finishes = 0
        self.built_on = []

    def unavailable(self):
        return self.why_not

    def device_count(self):
        return self.devices

    def describe(self, index):
        return f"fake:{index} (CPU stand-in)"

    def build(self, index, shape):
        self.built_on.append(index)
        rng = np.random.default_rng(index)
        w = rng.standard_normal((64, 64)).astype(np.float32) / 8
        x = rng.standard_normal((8, 64)).astype(np.float32)
        head = rng.standard_normal((64, 100)).astype(np.float32)

        def layer():
            self.layers += 1
            np.tanh(x @ w)

        def finish():
            self.finishes += 1
            return (x @ head).argmax(axis=1)
        return layer, finish


BACKEND = FakeBackend()
NO_GPU = FakeBackend(why_not="the fake sees no GPU")
