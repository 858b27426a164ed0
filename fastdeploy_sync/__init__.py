"""fastdeploy_sync: engine -> tensor-parallel worker task sync off the worker's critical path.

Engine side: ``TaskQueue``. Worker side, one per TP rank: ``TaskClient``.
Importing this package does not import paddle.
"""

from .engine import TaskQueue
from .errors import (BarrierTimeoutError, ClosedError, EndpointInUseError, EngineRejectedError,
                     GroupInUseError, PrefetchError, ProtocolError, TaskSyncError)
from .worker import TaskClient

__version__ = "0.1.0"

__all__ = [
    "TaskQueue",
    "TaskClient",
    "TaskSyncError",
    "PrefetchError",
    "ProtocolError",
    "EngineRejectedError",
    "BarrierTimeoutError",
    "GroupInUseError",
    "EndpointInUseError",
    "ClosedError",
]
