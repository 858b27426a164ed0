"""Objects a forked child inherited: every call on them raises there, and ``close()`` does
nothing.

A child made by ``os.fork()`` (FastDeploy forks helpers; ``multiprocessing``'s "fork"
start) holds a copy of each of its parent's objects. Their sockets, threads, locks and
shared-memory words are the parent's: libzmq is not fork-safe, a lock another thread held
at fork stays held in the child, and a rank's barrier arrival, acknowledgement or goodbye
made from the child acts for the parent (its group is retired, or takes a step out of
turn). So at fork (``shm.ownership.on_fork`` runs the object's ``after_fork_in_child``) a
``TaskQueue``, ``TaskClient``, ``TaskProducer`` or drop-in ``EngineWorkerQueue`` calls
``refuse_calls`` on itself (or registers ``refuse_in_child``, which does it at fork): every
public method of it raises ``ForkedProcessError`` in the child from then on, and its close
method returns at once, touching nothing. The methods are shadowed on the child's copy of
the instance, so the parent pays nothing: no check is added to any call. Nothing inherited
is closed either: pyzmq's ``close``/``term`` do nothing in a forked child, finalizers that
remove names check the pid that made them, and a rank's releases of shared memory are
published only by the process that decoded the batch (``shm.release``).
"""

import inspect
import os
import types
import weakref

from .errors import ForkedProcessError
from .shm.ownership import on_fork

__all__ = ["refuse_calls", "refuse_in_child"]


def refuse_calls(obj, what: str, owner_pid: int, idle: dict, private=()) -> None:
    """In a forked child: make every public method of ``obj`` (those its class defines or
    inherits; not class or static methods, not properties) raise ``ForkedProcessError``
    naming ``what`` (e.g. "TaskClient rank 1 of 'llm' dp_id=0"), the building process
    ``owner_pid`` and this one. ``idle``: method name -> the value it returns instead, doing
    nothing (``{"close": None}``); ``private``: private methods to refuse as well (those
    the object's helper objects call back). Never blocks, never raises."""
    message = str(ForkedProcessError.inherited(what, owner_pid, os.getpid()))

    def refuse(*args, **kwargs):
        raise ForkedProcessError(message)

    cls = type(obj)
    # after_fork_in_child stays: it runs again in a child this child forks
    names = ({n for n in dir(cls) if not n.startswith("_")} | set(private)) - {
        "after_fork_in_child"}
    for name in names:
        if isinstance(inspect.getattr_static(cls, name, None), types.FunctionType):
            setattr(obj, name, refuse)
    for name, value in idle.items():
        setattr(obj, name, lambda *args, _value=value, **kwargs: _value)


class _Refusal:
    """``refuse_in_child``'s guard: registered with ``on_fork``, it holds its object weakly
    and shadows its methods in a forked child."""

    def __init__(self, obj, what, idle, private):
        self._obj = weakref.ref(obj)
        self._what, self._idle, self._private = what, idle, private
        self._owner_pid = os.getpid()
        on_fork(self)

    def after_fork_in_child(self):
        obj = self._obj()
        if obj is not None:
            refuse_calls(obj, self._what, self._owner_pid, self._idle, self._private)


def refuse_in_child(obj, what: str, idle: dict, private=()):
    """From now on, in any child forked from this process, ``refuse_calls(obj, what, <this
    process's pid>, idle, private)`` runs at fork, before the child's own code. Returns the
    guard, which ``obj`` must keep referenced (the registry holds it weakly)."""
    return _Refusal(obj, what, idle, private)
