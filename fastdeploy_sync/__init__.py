"""fastdeploy_sync: engine -> tensor-parallel worker task sync off the worker's critical path.

Engine side: ``TaskQueue``. Worker side, one per TP rank: ``TaskClient``.
Importing this package does not import paddle, nor prometheus_client, and installs no
signal handler (``install_signal_cleanup()`` does, on request).
"""

from . import errors
from .cleanup import install_signal_cleanup
from .engine.queue import GroupLost, LostBatch, TaskProducer, TaskQueue
from .errors import *  # noqa: F401,F403 -- the public exceptions: errors.__all__
from .version import __version__  # noqa: F401
from .wire.liveness import Heartbeat
from .worker.client import TaskClient
from .worker.step_profiler import StepProfiler

__all__ = ["TaskQueue", "TaskClient", "TaskProducer", "GroupLost", "LostBatch", "Heartbeat",
           *errors.__all__, "install_signal_cleanup", "StepProfiler"]
