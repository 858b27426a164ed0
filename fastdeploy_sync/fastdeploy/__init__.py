"""FastDeploy drop-in: ``EngineWorkerQueue`` with FastDeploy's signature and methods, over this
library's ``TaskQueue``/``TaskClient``::

    # from fastdeploy.inter_communicator import EngineWorkerQueue
    from fastdeploy_sync.fastdeploy import EngineWorkerQueue

or, for FastDeploy itself (its engine, workers, connector and cache messagers), once
before it starts::

    import fastdeploy_sync.fastdeploy
    fastdeploy_sync.fastdeploy.install()

Modules, one concept each: ``queue`` (the class, its roles and FastDeploy's attribute
objects), ``engine_side`` and ``worker_side`` (the task path of each side), ``board`` (what
a TP group decides together), ``server`` (the server's queues and this process's
registry), ``watch`` (the engine's view of its worker group), ``channels``, ``links`` and
``channel_api`` (the side channels: state, transport, FastDeploy's methods), ``address``,
``clear`` (the engine's clear marker), ``tensors`` (``to_tensor``/``to_numpy``), ``install``
(``install()``: FastDeploy's every use of the class, in every process, gets the drop-in),
``run`` (``fastdeploy-sync run -- COMMAND``: the same for a command, unchanged),
``processes`` (the record of each process that uses the drop-in, for ``fastdeploy-sync
status``), ``subprocess_hook`` (the ``sitecustomize`` and the check on children).
docs/fastdeploy.md is the user's guide.
"""

from .install import install
from .queue import EngineWorkerQueue

__all__ = ["EngineWorkerQueue", "install"]
