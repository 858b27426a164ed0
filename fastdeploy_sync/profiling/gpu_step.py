"""The ``gpu`` model step: a small transformer decode step on a GPU, through paddle or torch.

One decode step of ``DecodeShape.batch`` sequences, each attending to a KV cache of
``kv_len`` tokens. Per layer: layer norm, the new token's QKV projection, attention over the
cache (scores, softmax, weighted values), the output projection, an MLP, two residuals. Then
the head: layer norm, the logits over ``vocab`` tokens, the argmax, and the host waiting
for the chosen token ids (a copy to host memory), as sampling does before the next step can
be scheduled. The profile's calibration repeats the layers (``layer()``, cycling through
``layers`` sets of weights) until a step takes ``--step-ms``; the head and the host's wait
(``finish()``) end every step. The KV cache is not extended: the step stands for the cost
of decoding, not for a model's output.

Every op a framework launches returns to Python having released the GIL for its dispatch,
as FastDeploy's decode loop does: a background thread of the process can take the GIL at
each of them, and the profile's GIL-wait figures count what that costs the step.

Backends (``resolve``):

``paddle``  a CUDA build of paddlepaddle (``paddle.is_compiled_with_cuda()``) and at least
            one visible GPU (``paddle.device.cuda.device_count()``);
``torch``   torch with ``torch.cuda.is_available()``;
``auto``    paddle when it qualifies, else torch: FastDeploy runs on paddle;
``cpu-standin``  no GPU: numpy on the CPU, to rehearse a GPU run's plumbing (never ``auto``).

Rank ``r`` of the run runs on visible GPU ``r % device_count()`` (round-robin; the ranks
share a GPU when there are fewer GPUs than ranks).

The seam: ``resolve("MODULE:ATTR")`` imports ``MODULE`` and returns its attribute ``ATTR``,
an object with the ``GpuBackend`` methods. ``fastdeploy-sync profile --gpu-backend
MODULE:ATTR`` (or ``ProfileOptions.gpu_backend``) hands it to the runner and to every worker
process, which import ``MODULE`` themselves (it must be importable there). The tests
run the whole ``gpu`` plumbing without a GPU this way, with a backend whose device work is
replaced by CPU work.

Importing this module imports neither paddle nor torch: a backend imports its framework
when it is asked whether it can run.
"""

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

__all__ = ["DecodeShape", "GpuBackend", "GpuUnavailable", "resolve", "BACKENDS", "STAND_INS"]


@dataclass(frozen=True)
class DecodeShape:
    """The decode step's sizes: ``layers`` sets of layer weights, ``hidden`` wide with
    ``heads`` attention heads, ``batch`` sequences, a KV cache of ``kv_len`` tokens per
    sequence and layer, a vocabulary of ``vocab`` tokens."""

    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    batch: int = 64
    kv_len: int = 512
    vocab: int = 32000

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")


class GpuUnavailable(RuntimeError):
    """No backend can run the ``gpu`` step here; the message says why, in one line."""


class GpuBackend(Protocol):
    """What the ``gpu`` step needs of a framework.

    ``unavailable()`` returns None when the backend can run here, else why not (a phrase,
    e.g. "torch is not installed"); it may import the framework. ``device_count()`` is the
    number of visible devices (>= 1 once ``unavailable()`` returned None).
    ``describe(index)`` names device ``index`` for the report (e.g. "torch 2.6.0 cuda:0
    NVIDIA H100 80GB HBM3"). ``build(index, shape)`` allocates the model on device
    ``index`` and returns ``(layer, finish)``: ``layer()`` launches the next layer,
    ``finish()`` the head, then blocks until the chosen token ids are in host memory.
    """

    name: str

    def unavailable(self) -> Optional[str]: ...

    def device_count(self) -> int: ...

    def describe(self, index: int) -> str: ...

    def build(self, index: int, shape: DecodeShape) -> tuple[Callable[[], None],
                                                            Callable[[], object]]: ...


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _import_paddle():
    import warnings

    with warnings.catch_warnings():  # paddle warns on import that ccache is missing
        warnings.simplefilter("ignore")
        import paddle
    return paddle


class PaddleBackend:
    """paddlepaddle on its CUDA devices (``gpu:N``), float16."""

    name = "paddle"

    def unavailable(self) -> Optional[str]:
        if not _installed("paddle"):
            return "paddlepaddle is not installed"
        paddle = _import_paddle()
        if not paddle.is_compiled_with_cuda():
            return "paddlepaddle is a CPU build (paddle.is_compiled_with_cuda() is False)"
        if paddle.device.cuda.device_count() < 1:
            return "paddlepaddle sees no GPU (paddle.device.cuda.device_count() is 0)"
        return None

    def device_count(self) -> int:
        return _import_paddle().device.cuda.device_count()

    def describe(self, index: int) -> str:
        paddle = _import_paddle()
        return (f"paddle {paddle.__version__} gpu:{index} "
                f"{paddle.device.cuda.get_device_name(index)}")

    def build(self, index, shape):
        return PaddleDecode(_import_paddle(), f"gpu:{index}", shape, "float16").step_parts()


class TorchBackend:
    """torch on its CUDA devices (``cuda:N``), float16."""

    name = "torch"

    def unavailable(self) -> Optional[str]:
        if not _installed("torch"):
            return "torch is not installed"
        import torch

        if not torch.cuda.is_available():
            return "torch sees no GPU (torch.cuda.is_available() is False)"
        return None

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def describe(self, index: int) -> str:
        import torch

        return f"torch {torch.__version__} cuda:{index} {torch.cuda.get_device_name(index)}"

    def build(self, index, shape):
        import torch

        return TorchDecode(torch, f"cuda:{index}", shape, torch.float16).step_parts()


class CpuStandInBackend:
    """No GPU: numpy on the CPU in place of the device, for rehearsing a GPU run (the
    plumbing, the report) on a machine without one (``scripts/benchmarks/gpu_server.py
    --dry-run``). Two "devices"; a layer is a small matmul (numpy releases the GIL inside
    it, as a framework's launch does), the end of step a smaller one and its argmax. Its
    figures describe this CPU, never a GPU: ``auto`` never picks it."""

    name = "cpu-standin"

    def unavailable(self) -> Optional[str]:
        return None

    def device_count(self) -> int:
        return 2

    def describe(self, index: int) -> str:
        return f"cpu-standin:{index} (numpy on the CPU; no GPU)"

    def build(self, index, shape):
        import numpy as np

        rng = np.random.default_rng(index)
        width = min(shape.hidden, 256)
        w = (rng.standard_normal((width, width)) / width ** 0.5).astype(np.float32)
        x = rng.standard_normal((min(shape.batch, 16), width)).astype(np.float32)
        head = rng.standard_normal((width, 128)).astype(np.float32)

        def layer():
            np.tanh(x @ w)

        def finish():
            return (x @ head).argmax(axis=1)
        return layer, finish


BACKENDS = {"paddle": PaddleBackend, "torch": TorchBackend}
# Named backends that ``auto`` never tries: their figures are not a GPU's.
STAND_INS = {"cpu-standin": CpuStandInBackend}


def resolve(name: str = "auto") -> GpuBackend:
    """The backend ``name`` names ("auto", "paddle", "torch" or "MODULE:ATTR"), checked
    to run here. Raises ``GpuUnavailable`` (one line: what was tried and why it cannot
    run) or ``ValueError`` (an unknown name, a MODULE:ATTR that does not import)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            backend = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--gpu-backend {name}: cannot import it ({exc})") from None
        tried = [backend]
    elif name == "auto":
        tried = [cls() for cls in BACKENDS.values()]
    elif name in BACKENDS:
        tried = [BACKENDS[name]()]
    elif name in STAND_INS:
        tried = [STAND_INS[name]()]
    else:
        raise ValueError(f"--gpu-backend {name!r}: expected auto, "
                         f"{', '.join([*BACKENDS, *STAND_INS])} or MODULE:ATTR")
    reasons = []
    for backend in tried:
        why = backend.unavailable()
        if why is None:
            return backend
        reasons.append(why)
    raise GpuUnavailable(f"no GPU to run the gpu step on: {'; '.join(reasons)} (it needs a "
                         f"CUDA build of paddlepaddle or torch and a visible GPU)")


# -- the decode step, one class per framework (the same ops in both) -----------------------

class _Decode:
    """What both frameworks' decode steps share: the weights drawn by the backend's
    ``randn(*size, scale=)`` (the same shapes in every backend), the state, and the order
    of the layers. Subclasses give ``layer()`` and ``finish()``."""

    def __init__(self, randn, shape: DecodeShape, F):
        b, h, n, length = shape.batch, shape.hidden, shape.heads, shape.kv_len
        d = h // n
        self.shape = shape
        self.x0 = randn(b, h)  # drawn in this order: x0, the layers, the head
        self.layers = [{"wqkv": randn(h, 3 * h, scale=h ** -0.5),
                        "wo": randn(h, h, scale=h ** -0.5),
                        "w1": randn(h, 4 * h, scale=h ** -0.5),
                        "w2": randn(4 * h, h, scale=(4 * h) ** -0.5),
                        "k": randn(b, n, d, length), "v": randn(b, n, length, d)}
                       for _ in range(shape.layers)]
        self.head = randn(h, shape.vocab, scale=h ** -0.5)
        self.scale = d ** -0.5
        self.F, self.dims = F, (b, h, n, d)
        self.x, self.next = self.x0, 0

    def step_parts(self):
        return self.layer, self.finish

    def _next_weights(self) -> dict:
        """The next layer's weights (the layers run in turn; ``finish`` starts afresh)."""
        w = self.layers[self.next]
        self.next = (self.next + 1) % len(self.layers)
        return w


class TorchDecode(_Decode):
    """The decode step's weights, KV cache and state on ``device`` (any torch device:
    "cuda:0", or "cpu" in the tests)."""

    def __init__(self, torch, device, shape: DecodeShape, dtype):
        self.torch = torch
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*size, scale=1.0):
            return torch.randn(*size, generator=gen, device=device, dtype=dtype) * scale

        super().__init__(randn, shape, torch.nn.functional)

    def layer(self) -> None:
        torch, F, (b, h, n, d) = self.torch, self.F, self.dims
        w = self._next_weights()
        x = self.x
        q, k, v = (F.layer_norm(x, (h,)) @ w["wqkv"]).view(b, 3, n, 1, d).unbind(1)
        scores = torch.softmax((q @ w["k"]) * self.scale, dim=-1)  # (b, n, 1, kv_len)
        x = x + (scores @ w["v"]).reshape(b, h) @ w["wo"]
        self.x = x + F.gelu(F.layer_norm(x, (h,)) @ w["w1"]) @ w["w2"]

    def finish(self):
        """The head and the host's wait for the token ids; the next step starts afresh."""
        F, h = self.F, self.dims[1]
        ids = (F.layer_norm(self.x, (h,)) @ self.head).argmax(dim=-1)
        self.x, self.next = self.x0, 0
        return ids.cpu()  # blocks until the device is done: the host needs the ids to go on


class PaddleDecode(_Decode):
    """The same decode step in paddle, on ``device`` ("gpu:0", or "cpu" in the tests)."""

    def __init__(self, paddle, device, shape: DecodeShape, dtype):
        self.paddle = paddle
        paddle.set_device(device)
        paddle.seed(0)

        def randn(*size, scale=1.0):
            return (paddle.randn(list(size)) * scale).astype(dtype)

        super().__init__(randn, shape, paddle.nn.functional)

    def layer(self) -> None:
        paddle, F, (b, h, n, d) = self.paddle, self.F, self.dims
        w = self._next_weights()
        with paddle.no_grad():
            x = self.x
            qkv = paddle.matmul(F.layer_norm(x, [h]), w["wqkv"]).reshape([b, 3, n, 1, d])
            q = qkv[:, 0]
            scores = F.softmax(paddle.matmul(q, w["k"]) * self.scale, axis=-1)
            x = x + paddle.matmul(paddle.matmul(scores, w["v"]).reshape([b, h]), w["wo"])
            self.x = x + paddle.matmul(F.gelu(paddle.matmul(F.layer_norm(x, [h]), w["w1"])),
                                       w["w2"])

    def finish(self):
        """The head and the host's wait for the token ids; the next step starts afresh."""
        paddle, F, h = self.paddle, self.F, self.dims[1]
        with paddle.no_grad():
            ids = paddle.argmax(paddle.matmul(F.layer_norm(self.x, [h]), self.head), axis=-1)
        self.x, self.next = self.x0, 0
        return ids.numpy()  # blocks until the device is done
