"""FastDeploy's ``EngineWorkerQueue.to_tensor`` / ``to_numpy``: multimodal inputs between numpy
arrays and paddle tensors, in place. paddle is imported only when a conversion needs it."""

import os
import sys
from typing import Any

import numpy as np

__all__ = ["to_tensor", "to_numpy", "TENSOR_KEYS"]

# the multimodal inputs FastDeploy converts
TENSOR_KEYS = ("images", "patch_idx", "token_type_ids", "position_ids", "attention_mask_offset")
_SWITCHES = ("FD_ENABLE_MAX_PREFILL", "FD_ENABLE_E2W_TENSOR_CONVERT")


def _enabled() -> bool:
    """FastDeploy's switches: either set to a non-zero value."""
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in _SWITCHES)


def _requests(batch):
    """The requests of a ``(requests, bsz)`` batch, or the list itself."""
    if isinstance(batch, tuple) and batch and isinstance(batch[0], (list, tuple)):
        return batch[0]
    return batch


def _inputs(batch):
    """``(inputs, key, value)`` for every key of ``TENSOR_KEYS`` present in the
    ``multimodal_inputs`` of each request of ``batch``."""
    for request in _requests(batch):
        inputs = getattr(request, "multimodal_inputs", None)
        if not inputs:
            continue
        for key in TENSOR_KEYS:
            value = inputs.get(key)
            if value is not None:
                yield inputs, key, value


def to_tensor(tasks) -> None:
    """When ``FD_ENABLE_MAX_PREFILL`` or ``FD_ENABLE_E2W_TENSOR_CONVERT`` is set (FastDeploy's
    switches, read from the environment): in each request of ``tasks`` (a ``(requests,
    bsz)`` batch or a list of requests), every numpy array under ``TENSOR_KEYS`` of its
    ``multimodal_inputs`` becomes a paddle tensor, in place. Otherwise nothing happens.
    ``ImportError`` if a conversion is due and paddle is not installed."""
    if not _enabled():
        return
    paddle: Any = None  # imported at the first array
    for inputs, key, value in _inputs(tasks):
        if isinstance(value, np.ndarray):
            if paddle is None:
                import paddle
            inputs[key] = paddle.to_tensor(value)


def to_numpy(tasks) -> None:
    """The reverse for a list of ``(requests, bsz)`` batches: every paddle tensor under
    ``TENSOR_KEYS`` becomes a numpy array, in place. Never imports paddle (a process that
    has not imported it holds no paddle tensor)."""
    paddle = sys.modules.get("paddle")
    if paddle is None:
        return
    for batch in tasks:
        for inputs, key, value in _inputs(batch):
            if isinstance(value, paddle.Tensor):
                inputs[key] = value.numpy()
