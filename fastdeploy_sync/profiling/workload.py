"""What the profiled processes do besides task sync: a simulated model step and the batches.

A model step is a *fixed amount of work*, calibrated once per worker to take ``step_ms``
when nothing else runs. It is not "work until a deadline": a step that loses the GIL or
the CPU to a background thread must get longer, or the profiler could not see the loss.

``python``  pure-Python integer arithmetic: holds the GIL the whole step.
``numpy``   128x128 float32 matmul + tanh rounds: releases the GIL inside each call and
            takes it back between calls (where a GIL-holding thread would delay it).
``paddle``  forwards of a small transformer block on paddle CPU (attention + MLP); each
            op releases and re-takes the GIL, as a GPU model's kernel launches do (measured
            with ``scripts/gil_wait_check.py``: a thread holding the GIL 1 ms in every 4
            delays it 3.5-5.6x as much (lower bounds, two runs) as the ``python`` step, which gives the GIL up only
            at the interpreter's 5 ms switch interval). Imports paddle (~1.5 s) in the
            worker, and only there.
``sleep``   ``time.sleep(step_ms)``: no CPU, no GIL (the step a GPU kernel launch leaves).

Batches are ``{"batch_id", "put_ns", "requests"}`` with ``requests`` a list of
FastDeploy-like request dicts whose ``prompt_token_ids`` are int64 numpy arrays, or Python
lists with ``tokens="list"``.
"""

import importlib.util
import time

import numpy as np

__all__ = ["STEP_KINDS", "TOKEN_KINDS", "ModelStep", "RequestPool", "default_step_kinds"]

STEP_KINDS = ("python", "numpy", "paddle", "sleep")


def default_step_kinds() -> list:
    """``["python", "paddle"]``, or ``["python"]`` where paddle is not installed: the
    step that holds the GIL and the one that releases it. Looks paddle up without
    importing it."""
    return ["python", "paddle"] if importlib.util.find_spec("paddle") else ["python"]
TOKEN_KINDS = ("numpy", "list")

# Calibration: time this many rounds of a quarter step each and keep the median. The
# fastest round undershoots a typical step by 5-25 % (paddle's allocator, caches), the
# mean follows whichever process happened to take the CPU.
_CALIBRATION_ROUNDS = 15


class ModelStep:
    """``ModelStep(kind, step_ms)()`` runs one simulated model step of ``units`` units of
    work; ``units`` is set by ``calibrate()`` (at least 1). Blocks for the step's length."""

    def __init__(self, kind: str, step_ms: float):
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind {kind!r}: expected one of {', '.join(STEP_KINDS)}")
        if not step_ms > 0:
            raise ValueError(f"step_ms={step_ms!r}: expected > 0")
        self.kind, self.step_ms = kind, float(step_ms)
        self.units = 1
        self.unit_us = None
        self._unit = getattr(self, f"_build_{kind}")()

    def __call__(self) -> None:
        unit = self._unit
        for _ in range(self.units):
            unit()

    def calibrate(self) -> dict:
        """Pick ``units`` so that one step takes ``step_ms`` undisturbed; returns what it
        measured (``{"kind", "units", "unit_us"}``). Takes ~15 steps' time."""
        if self.kind == "sleep":
            self.unit_us = self.step_ms * 1000
            return self.describe()
        self._unit()  # warm up (first-call allocations, paddle kernel selection)
        probe = 4
        best = min(self._time_units(probe) for _ in range(3)) / probe
        probe = max(1, int(self.step_ms * 1e6 / best / 4))  # ~a quarter step per round
        best = float(np.median([self._time_units(probe) for _ in range(_CALIBRATION_ROUNDS)])) / probe
        self.unit_us = best / 1000
        self.units = max(1, round(self.step_ms * 1e6 / best))
        return self.describe()

    def describe(self) -> dict:
        return {"kind": self.kind, "step_ms": self.step_ms, "units": self.units,
                "unit_us": self.unit_us}

    def _time_units(self, n: int) -> int:
        unit, now = self._unit, time.perf_counter_ns
        t0 = now()
        for _ in range(n):
            unit()
        return now() - t0

    # -- the units -------------------------------------------------------------------------

    def _build_python(self):
        def unit():  # ~10 us of bytecode; never releases the GIL
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

    def _build_sleep(self):
        seconds = self.step_ms / 1000

        def unit():
            time.sleep(seconds)
        return unit


class RequestPool:
    """Builds the batches the engine puts, from a few pre-generated request lists (so the
    engine, which shares the 2 cores with the workers, spends little CPU per batch)."""

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
