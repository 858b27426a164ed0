"""fastdeploy_sync: engine -> tensor-parallel worker task sync off the worker's critical path.

Engine side: ``TaskQueue``. Worker side, one per TP rank: ``TaskClient``.
Importing this package does not import paddle, nor prometheus_client, and installs no
signal handler (``install_signal_cleanup()`` does, on request).
"""

from .cleanup import install_signal_cleanup
from .engine.queue import GroupLost, LostBatch, TaskProducer, TaskQueue
from .errors import (AuthenticationError, BarrierTimeoutError, ClosedError, EndpointInUseError,
                     EngineClosedError, EngineGoneError, EngineRejectedError,
                     EngineUnreachableError, GroupInUseError, GroupLostError, PrefetchError,
                     ProtocolError, TaskSyncError)
from .wire.liveness import Heartbeat
from .worker.client import TaskClient

__version__ = "0.1.0"

__all__ = [
    "TaskQueue",
    "TaskClient",
    "TaskProducer",
    "GroupLost",
    "LostBatch",
    "Heartbeat",
    "TaskSyncError",
    "PrefetchError",
    "ProtocolError",
    "EngineRejectedError",
    "BarrierTimeoutError",
    "GroupInUseError",
    "EndpointInUseError",
    "ClosedError",
    "EngineGoneError",
    "EngineClosedError",
    "GroupLostError",
    "EngineUnreachableError",
    "AuthenticationError",
    "install_signal_cleanup",
]
