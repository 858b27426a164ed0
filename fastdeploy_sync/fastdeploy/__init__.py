"""FastDeploy drop-in: ``EngineWorkerQueue`` with FastDeploy's signature and methods, over this
library's ``TaskQueue``/``TaskClient``::

    # from fastdeploy.inter_communicator import EngineWorkerQueue
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

Modules, one concept each: ``queue`` (the class, its roles and FastDeploy's attribute
objects), ``engine_side`` and ``worker_side`` (the task path of each side), ``board`` (what
a TP group decides together), ``server`` (the server's queues and this process's
registry), ``watch`` (the engine's view of its worker group), ``channels``, ``links`` and
``channel_api`` (the side channels: state, transport, FastDeploy's methods), ``address``,
``clear`` (the engine's clear marker), ``tensors`` (``to_tensor``/``to_numpy``).
docs/fastdeploy.md is the user's guide.
"""

from .queue import EngineWorkerQueue

__all__ = ["EngineWorkerQueue"]
