"""What the profiled processes do besides task sync: a simulated model step and the batches.

A model step is a *fixed amount of work*, calibrated once per worker to take ``step_ms``
when nothing else runs. It is not "work until a deadline": a step that loses the GIL or
the CPU to a background thread must get longer, or the profiler could not see the loss.

``python``  pure-Python integer arithmetic: holds the GIL the whole step.
``numpy``   128x128 float32 matmul + tanh rounds: releases the GIL inside each call and
            takes it back between calls (where a GIL-holding thread would delay it).
``paddle``  forwards of a small transformer block on paddle CPU (attention + MLP); each
            op releases and re-takes the GIL, as a GPU model's kernel launches do, so a
            thread holding the GIL delays it more than the ``python`` step, which gives the
            GIL up only at the interpreter's switch interval (``scripts/tools/gil_wait_check.py``
            measures both). Imports paddle in the worker, and only there.
``gpu``     a transformer decode step on a GPU through paddle or torch, ending with the host
            waiting for the chosen token ids (``gpu_step``): the step FastDeploy's decode
            loop runs. Rank ``r`` runs on visible GPU ``r % count``.
``sleep``   ``time.sleep(step_ms)``: no CPU, no GIL.

Batches are ``{"batch_id", "put_ns", "requests"}`` with ``requests`` a list of
FastDeploy-like request dicts whose ``prompt_token_ids`` are int64 numpy arrays, or Python
lists with ``tokens="list"``.
"""

import time
from typing import Optional

import numpy as np

from .options import STEP_KINDS, TOKEN_KINDS

__all__ = ["STEP_KINDS", "TOKEN_KINDS", "ModelStep", "RequestPool"]

# Calibration: time this many rounds of a quarter step each and keep the median. The
# fastest round undershoots a typical step (paddle's allocator, caches), the mean follows
# whichever process happened to take the CPU.
_CALIBRATION_ROUNDS = 15


class ModelStep:
    """``ModelStep(kind, step_ms)()`` runs one simulated model step: ``units`` units of
    work, then the kind's end of step where it has one (``gpu``: the head and the host's
    wait for the token ids). ``units`` is set by ``calibrate()`` (at least 1). Blocks for
    the step's length.

    ``rank`` and ``gpu_backend`` concern the ``gpu`` kind only: the rank picks the GPU
    (``rank % device_count``), the backend is ``gpu_step.resolve``'s name (``auto``,
    ``paddle``, ``torch`` or ``MODULE:ATTR``). Building a ``gpu`` step raises
    ``gpu_step.GpuUnavailable`` where no backend can run.
    """

    def __init__(self, kind: str, step_ms: float, rank: int = 0, gpu_backend: str = "auto"):
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r}: expected one of {', '.join(STEP_KINDS)}")
        if not step_ms > 0:
            raise ValueError(f"step_ms={step_ms!r}: expected > 0")
        self.kind, self.step_ms = kind, float(step_ms)
        self.rank, self.gpu_backend = rank, gpu_backend
        self.units = 1
        self.unit_us: Optional[float] = None  # calibrate() measures it
        self.fixed_us = 0.0  # the end of step's time (gpu: head and wait), from calibrate()
        self.device = None  # where the step runs, for the report (gpu: the device)
        self._finish = None
        self._unit = getattr(self, f"_build_{kind}")()

    def __call__(self) -> None:
        unit = self._unit
        for _ in range(self.units):
            unit()
        if self._finish is not None:
            self._finish()

    def calibrate(self) -> dict:
        """Pick ``units`` so that one step takes ``step_ms`` undisturbed; returns what it
        measured (``describe()``). Takes about 15 steps' time (gpu: about 25)."""
        if self.kind == "sleep":
            self.unit_us = self.step_ms * 1000
            return self.describe()
        self._time_units(1)  # warm up (first-call allocations, kernel selection)
        probe = 4
        best = min(self._time_units(probe) for _ in range(3)) / probe
        probe = max(1, int(self.step_ms * 1e6 / best / 4))  # ~a quarter step per round
        if self._finish is None:
            per_unit = float(np.median([self._time_units(probe)
                                        for _ in range(_CALIBRATION_ROUNDS)])) / probe
            fixed = 0.0
        else:
            # Two lengths, interleaved: the difference is the units' time, the rest is the
            # end of step's (a GPU's head and the host's wait are paid once per step).
            pairs = [(self._time_units(probe), self._time_units(2 * probe))
                     for _ in range(_CALIBRATION_ROUNDS)]
            t1 = float(np.median([a for a, _ in pairs]))
            t2 = float(np.median([b for _, b in pairs]))
            per_unit = (t2 - t1) / probe if t2 > t1 else t2 / (2 * probe)
            fixed = max(0.0, t1 - probe * per_unit)
        self.unit_us, self.fixed_us = per_unit / 1000, fixed / 1000
        self.units = max(1, round((self.step_ms * 1e6 - fixed) / per_unit))
        return self.describe()

    def describe(self) -> dict:
        return {"kind": self.kind, "step_ms": self.step_ms, "units": self.units,
                "unit_us": self.unit_us, "fixed_us": self.fixed_us, "device": self.device}

    def _time_units(self, n: int) -> int:
        """Nanoseconds that ``n`` units and the end of step take."""
        unit, finish, now = self._unit, self._finish, time.perf_counter_ns
        t0 = now()
        for _ in range(n):
            unit()
        if finish is not None:
            finish()
        return now() - t0

    # -- the units -------------------------------------------------------------------------

    def _build_python(self):
        def unit():  # a few microseconds of bytecode; never releases the GIL
            x = 1
            for i in range(200):
                x = (x * 1103515245 + i) & 0xFFFFFFFF
            return x
        return unit

    def _build_numpy(self):
        rng = np.random.default_rng(0)
        w = (rng.standard_normal((128, 128)) / 12).astype(np.float32)
        x = rng.standard_normal((128, 128)).astype(np.float32)
        out = np.empty_like(x)

        def unit():
            np.matmul(x, w, out=out)
            np.tanh(out, out=out)
        return unit

    def _build_paddle(self):
        import warnings

        with warnings.catch_warnings():  # paddle warns on import that ccache is missing
            warnings.simplefilter("ignore")
            import paddle  # only here: importing paddle costs seconds and ~700 MB

        paddle.set_device("cpu")
        rows, hidden, heads = 16, 128, 4
        head_dim = hidden // heads
        paddle.seed(0)
        wqkv = paddle.randn([hidden, 3 * hidden]) / hidden ** 0.5
        wo = paddle.randn([hidden, hidden]) / hidden ** 0.5
        w1 = paddle.randn([hidden, 4 * hidden]) / hidden ** 0.5
        w2 = paddle.randn([4 * hidden, hidden]) / (4 * hidden) ** 0.5
        x = paddle.randn([rows, hidden])
        F = paddle.nn.functional

        @paddle.no_grad()
        def unit():  # one transformer block: attention over `rows` tokens, then the MLP
            qkv = paddle.matmul(x, wqkv).reshape([rows, 3, heads, head_dim])
            q, k, v = (qkv[:, i].transpose([1, 0, 2]) for i in range(3))
            scores = F.softmax(paddle.matmul(q, k, transpose_y=True) / head_dim ** 0.5, axis=-1)
            attn = paddle.matmul(scores, v).transpose([1, 0, 2]).reshape([rows, hidden])
            h = F.layer_norm(x + paddle.matmul(attn, wo), [hidden])
            out = F.layer_norm(h + paddle.matmul(F.gelu(paddle.matmul(h, w1)), w2), [hidden])
            return float(out[0, 0])  # force execution
        return unit

    def _build_gpu(self):
        from .gpu_step import DecodeShape, resolve

        backend = resolve(self.gpu_backend)
        index = self.rank % backend.device_count()
        self.device = backend.describe(index)
        layer, self._finish = backend.build(index, DecodeShape())
        return layer

    def _build_sleep(self):
        seconds = self.step_ms / 1000

        def unit():
            time.sleep(seconds)
        return unit


class RequestPool:
    """Builds the batches the engine puts, from a few pre-generated request lists (so the
    engine, which may share its cores with the workers, spends little CPU per batch)."""

    VARIANTS = 4

    def __init__(self, batch: int, prompt_len: int, tokens: str = "numpy", seed: int = 0):
        if tokens not in TOKEN_KINDS:
            raise ValueError(f"tokens={tokens!r}: expected one of {', '.join(TOKEN_KINDS)}")
        if batch < 1 or prompt_len < 1:
            raise ValueError(f"batch={batch}, prompt_len={prompt_len}: expected >= 1 each")
        rng = np.random.default_rng(seed)
        self._variants = []
        for _ in range(self.VARIANTS):
            requests = []
            for i in range(batch):
                ids = rng.integers(0, 100_000, prompt_len, dtype=np.int64)
                requests.append({"request_id": f"r{i}", "max_tokens": int(rng.integers(4, 64)),
                                 "prompt_token_ids": ids.tolist() if tokens == "list" else ids})
            self._variants.append(requests)

    def batch(self, batch_id: int) -> dict:
        """Batch ``batch_id``, stamped now (``put_ns``, ``time.perf_counter_ns``: the
        system-wide monotonic clock on Linux, comparable across processes)."""
        return {"batch_id": batch_id, "put_ns": time.perf_counter_ns(),
                "requests": self._variants[batch_id % self.VARIANTS]}
