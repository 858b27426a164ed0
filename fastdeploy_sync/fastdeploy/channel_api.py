"""FastDeploy's side-channel methods and attribute objects of ``EngineWorkerQueue`` (cache
infos, finished requests, disaggregated and RDMA connect tasks, prefill instances, the seven
cache-messager barriers, the DP group's lock), over a link to the server's
``channels.ChannelState`` (``links``).

FastDeploy waits without a bound where a channel is not ready (a put until every client
read the previous item, a get until every client put, a barrier, the lock). Here every wait
is bounded: ``timeout`` seconds when given, else ``FD_SYNC_SIDE_WAIT_S`` (``DEFAULT_WAIT_S``,
300, by default); then ``TimeoutError`` naming the channel and the endpoint. A wait that
ran out changes nothing in its channel, so the next call finds it as it was. A barrier
wait that runs out raises ``threading.BrokenBarrierError`` and breaks that round for every
party (the others, and the late one when it comes, raise it too), as ``threading.Barrier``
does; unlike it, the next round is whole again, without a ``reset()``: FastDeploy's cache
messagers never reset a barrier, and would otherwise fail every later round.
"""

import os
import queue
import secrets
import threading
import time
from typing import Optional

from .. import envs
from .channels import BARRIERS, BarrierBroken, NotReady
from .links import call_until

__all__ = ["ChannelMethods", "SideBarrier", "SideLock", "PrefillInstances", "DEFAULT_WAIT_S"]

DEFAULT_WAIT_S = 300.0  # FD_SYNC_SIDE_WAIT_S unset (envs.side_wait_s)


def _deadline(timeout):
    return time.monotonic() + (envs.side_wait_s() if timeout is None else max(0.0, timeout))


class ChannelMethods:
    """Mixed into ``EngineWorkerQueue``: FastDeploy's side-channel methods. Each method is
    one request (a round trip to the server), or several while it
    waits. The class implements ``_side()``."""

    def _side(self):
        """``(link, dp_id, client_id)``: the link to the server's side channels (a
        ``links.LocalLink`` or ``RemoteLink``), this client's DP group and TP rank (-1 on the
        server). ``ClosedError`` after ``cleanup()``. The attribute objects below call it."""
        raise NotImplementedError

    def num_cache_infos(self) -> int:
        """Cache infos put and not yet read by every client of this DP group."""
        link, dp, cid = self._side()
        return link.call("num_cache_infos", dp, cid)

    def put_cache_info(self, cache_info, *, timeout: Optional[float] = None) -> None:
        """Replace the DP group's cache infos with ``cache_info`` (an iterable), once every
        client has read the previous ones (until then it waits; at the start every client
        must have asked once, as in FastDeploy)."""
        link, dp, cid = self._side()
        call_until(link, "put_cache_info", dp, cid, list(cache_info), _deadline(timeout),
                   "put_cache_info (waiting for every client to read the previous infos)")

    def get_cache_info(self) -> list:
        """This client's unread cache infos (``[]`` if it read them already); the last
        client to read them empties the list."""
        link, dp, cid = self._side()
        return link.call("get_cache_info", dp, cid)

    def put_finished_req(self, send_cache_result, *, timeout: Optional[float] = None) -> bool:
        """Report ``send_cache_result[0]`` for this client; waits while the engine has not
        collected the previous round. True when every client of the group has reported."""
        link, dp, cid = self._side()
        return call_until(link, "put_finished_req", dp, cid, send_cache_result,
                          _deadline(timeout), "put_finished_req (the engine has not taken "
                          "the previous round)")

    def get_finished_req(self, *, timeout: Optional[float] = None) -> list:
        """Engine: ``[]`` if nothing was reported; else, once every client reported, the
        round as ``[first report]`` (with any client's error status) and a new round."""
        link, dp, cid = self._side()
        return call_until(link, "get_finished_req", dp, cid, None, _deadline(timeout),
                          "get_finished_req (waiting for every client's report)")

    def put_finished_add_cache_task_req(self, req_ids, *, timeout: Optional[float] = None) -> bool:
        """As ``put_finished_req``, for finished add-cache tasks (``req_ids`` as is)."""
        link, dp, cid = self._side()
        return call_until(link, "put_finished_add_cache_task_req", dp, cid, req_ids,
                          _deadline(timeout), "put_finished_add_cache_task_req (the engine "
                          "has not taken the previous round)")

    def get_finished_add_cache_task_req(self, *, timeout: Optional[float] = None):
        """Engine: ``[]`` if nothing was reported; else, once every client reported, the
        reported ids (every client reports the same)."""
        link, dp, cid = self._side()
        return call_until(link, "get_finished_add_cache_task_req", dp, cid, None,
                          _deadline(timeout), "get_finished_add_cache_task_req (waiting "
                          "for every client's report)")

    def put_disaggregated_tasks(self, item) -> None:
        link, dp, cid = self._side()
        link.call("put_disaggregated_tasks", dp, cid, item)

    def get_disaggregated_tasks(self):
        """Every queued item, in order (the queue empties), or None when there is none."""
        link, dp, cid = self._side()
        return link.call("get_disaggregated_tasks", dp, cid)

    def disaggregate_queue_empty(self) -> bool:
        link, dp, cid = self._side()
        return link.call("disaggregate_queue_empty", dp, cid)

    def put_connect_rdma_task(self, connect_rdma_task, *, timeout: Optional[float] = None) -> None:
        """Offer one RDMA connect task to every client, once every client read the
        previous one."""
        link, dp, cid = self._side()
        call_until(link, "put_connect_rdma_task", dp, cid, connect_rdma_task,
                   _deadline(timeout), "put_connect_rdma_task (waiting for every client to "
                   "read the previous task)")

    def get_connect_rdma_task(self):
        """``(task or None, all_client_read)``; the last reader empties it."""
        link, dp, cid = self._side()
        return tuple(link.call("get_connect_rdma_task", dp, cid))

    def put_connect_rdma_task_response(self, connect_rdma_task_response, *,
                                       timeout: Optional[float] = None) -> bool:
        """This client's response; waits while the engine has not collected the previous
        round. True when every client responded."""
        link, dp, cid = self._side()
        return call_until(link, "put_connect_rdma_task_response", dp, cid,
                          connect_rdma_task_response, _deadline(timeout),
                          "put_connect_rdma_task_response (the engine has not taken the "
                          "previous round)")

    def get_connect_rdma_task_response(self, *, timeout: Optional[float] = None):
        """Engine: None if no client responded; else, once every client did, the first
        response with ``success`` True only if every client's was."""
        link, dp, cid = self._side()
        return call_until(link, "get_connect_rdma_task_response", dp, cid, None,
                          _deadline(timeout), "get_connect_rdma_task_response (waiting for "
                          "every client's response)")

    def get_prefill_instances(self):
        """One entry of ``available_prefill_instances``, or 0 when it is empty."""
        link, dp, cid = self._side()
        try:
            return link.call("prefill_get", dp, cid)
        except NotReady:
            return 0


class _SideObject:
    def __init__(self, owner):
        self._owner = owner


class SideBarrier(_SideObject):
    """One of the cache messager's barriers of a DP group: ``threading.Barrier``'s interface
    for ``num_client`` parties in any processes (``wait``, ``reset``, ``abort``, ``parties``,
    ``n_waiting``, ``broken``). A party is a thread of a process using this object: its
    k-th ``wait()`` is its arrival in the barrier's k-th round since it first waited."""

    def __init__(self, owner, name):
        super().__init__(owner)
        self.name = name
        self._party = threading.local()  # this thread's token (an ident may be reused)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Block until ``parties`` parties arrived in this party's round; return this one's
        arrival index (0 .. parties - 1). ``threading.BrokenBarrierError`` if the round is or
        becomes broken (a waiter of it timed out, ``abort()``, ``reset()``), or, breaking
        the round for every party, after ``timeout`` s (None: ``FD_SYNC_SIDE_WAIT_S``). The
        next round is whole again: a party that was late raises for the round it was late
        for and then waits with the others in the next."""
        link, dp, cid = self._owner._side()
        deadline = _deadline(timeout)
        token = getattr(self._party, "token", None)
        if token is None:
            token = self._party.token = (os.getpid(), secrets.randbits(64))
        try:
            r, index = link.call("barrier_arrive", dp, cid, (self.name, token))
            try:
                call_until(link, "barrier_poll", dp, cid, (self.name, r), deadline, self.name)
            except TimeoutError:
                if link.call("barrier_abort", dp, cid, (self.name, r)):
                    return index  # it passed just as the wait ended
                raise
            return index
        except BarrierBroken:
            raise threading.BrokenBarrierError(
                f"{self.name} of DP group {dp} at {link.endpoint}: this round is broken (a "
                f"waiter of it timed out, or abort()/reset() was called); the next wait() "
                f"joins the next round") from None
        except TimeoutError:
            raise threading.BrokenBarrierError(
                f"{self.name} of DP group {dp} at {link.endpoint}: not every one of the "
                f"{self.parties} parties arrived within the wait; this round is broken for "
                f"every party, the next wait() joins the next round (the bound: timeout=, "
                f"else FD_SYNC_SIDE_WAIT_S)") from None

    def reset(self) -> None:
        link, dp, cid = self._owner._side()
        link.call("barrier_reset", dp, cid, self.name)

    def abort(self) -> None:
        link, dp, cid = self._owner._side()
        link.call("barrier_abort", dp, cid, (self.name, None))

    def _state(self):
        link, dp, cid = self._owner._side()
        return link.call("barrier_state", dp, cid, self.name)

    @property
    def parties(self) -> int:
        return self._state()["parties"]

    @property
    def n_waiting(self) -> int:
        return self._state()["n_waiting"]

    @property
    def broken(self) -> bool:
        return self._state()["broken"]


class SideLock(_SideObject):
    """FastDeploy's ``lock`` of a DP group (its task list's lock): a ``threading.Lock`` that
    works across processes. A holder that dies keeps it held: other acquirers then wait
    out their bound."""

    def __init__(self, owner):
        super().__init__(owner)
        self._token = (os.getpid(), secrets.randbits(32))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``; ``timeout=-1`` (no bound there) waits at most
        ``FD_SYNC_SIDE_WAIT_S`` here, then raises ``TimeoutError``."""
        link, dp, cid = self._owner._side()
        if not blocking:
            try:
                return link.call("lock_acquire", dp, cid, self._token)
            except NotReady:
                return False
        wait = envs.side_wait_s() if timeout is None or timeout < 0 else timeout
        try:
            return call_until(link, "lock_acquire", dp, cid, self._token,
                              time.monotonic() + wait, "lock.acquire()")
        except TimeoutError:
            if timeout is None or timeout < 0:
                raise TimeoutError(f"lock of DP group {dp} at {link.endpoint}: held by "
                                   f"another client for {wait:g} s (did its process die "
                                   f"holding it?)") from None
            return False

    def release(self) -> None:
        """``ValueError``-like ``RuntimeError`` when the lock is not held."""
        link, dp, cid = self._owner._side()
        try:
            link.call("lock_release", dp, cid, self._token)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None

    def locked(self) -> bool:
        link, dp, cid = self._owner._side()
        return link.call("lock_locked", dp, cid)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class PrefillInstances(_SideObject):
    """FastDeploy's ``available_prefill_instances`` (a ``queue.Queue`` of the server, shared
    by its DP groups): ``put``, ``get``, ``get_nowait``, ``qsize``, ``empty``."""

    def put(self, item, block=True, timeout=None) -> None:
        link, dp, cid = self._owner._side()
        link.call("prefill_put", dp, cid, item)

    def get(self, block: bool = True, timeout: Optional[float] = None):
        """The oldest entry; ``queue.Empty`` when there is none (``block``: after waiting
        ``timeout`` s, None: ``FD_SYNC_SIDE_WAIT_S``)."""
        link, dp, cid = self._owner._side()
        deadline = _deadline(timeout) if block else time.monotonic()
        try:
            return call_until(link, "prefill_get", dp, cid, None, deadline,
                              "available_prefill_instances.get()")
        except TimeoutError:
            raise queue.Empty from None

    def get_nowait(self):
        return self.get(block=False)

    def qsize(self) -> int:
        link, dp, cid = self._owner._side()
        return link.call("prefill_qsize", dp, cid)

    def empty(self) -> bool:
        return self.qsize() == 0


def make_barriers(owner) -> dict:
    """FastDeploy's seven cache-messager barrier attributes of ``owner``."""
    return {name: SideBarrier(owner, name) for name in BARRIERS}
