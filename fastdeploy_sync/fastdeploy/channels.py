"""FastDeploy's side channels of ``EngineWorkerQueue`` (everything but the task path), as one
thread-safe state object the server owns: cache infos, finished requests, finished
add-cache tasks, disaggregated tasks, RDMA connect tasks and their responses, prefill
instances, the cache messager's barriers and the per-DP-group lock.

Semantics mirror FastDeploy develop's ``EngineWorkerQueue`` (read from its source, not
copied): the same per-client read and put flags, the same "wait until every client read /
put" rules, the same return values. What FastDeploy does by sleeping in a loop while it
holds a manager lock, a call here answers at once: ``NotReady`` tells the caller (the
client side, ``links.call_until``) to ask again, with a bounded wait. Nothing here blocks.

Bounds: every list and queue holds at most ``MAX_ITEMS`` entries (a put beyond raises
``OverflowError`` naming the channel); a message's size is bounded by the transport.
"""

import collections
import logging
import threading

__all__ = ["ChannelState", "NotReady", "BarrierBroken", "MAX_ITEMS", "BARRIERS", "OPERATIONS"]

log = logging.getLogger(__name__)

MAX_ITEMS = 4096
# The cache messager's barriers (N-party, N = num_client), per DP group.
BARRIERS = ("finish_request_barrier", "finish_send_cache_barrier", "begin_send_cache_barrier",
            "connect_task_barrier", "connect_task_response_barrier", "cache_info_barrier",
            "finish_add_cache_task_barrier")


class NotReady(Exception):
    """The call would wait in FastDeploy: ask again."""


class BarrierBroken(Exception):
    """This round of the barrier is broken (a waiter of it timed out, ``abort()``,
    ``reset()``)."""


# Parties a barrier remembers (a thread of a process, see ``SideBarrier``): past this, the
# least recently seen are forgotten (one that comes back rejoins at the open round).
_MAX_PARTIES = 4096
# Rounds whose outcome (broken) a barrier remembers for waiters still polling them.
_BROKEN_MEMORY = 1024


class _Barrier:
    """``threading.Barrier`` over calls, by rounds. Round ``gen`` is open; it ends once
    ``parties`` parties arrived in it. Each party (a token) has its own round count: its
    k-th arrival belongs to round ``first + k``, so a party that arrives early (it gave up
    on a round the others have not all reached yet) is counted in a later round, never in
    the open one, and a late party fills the round it is late for. A round is broken
    when one of its waiters timed out (or ``reset()`` ended it): every party learns that
    round failed, and the next round is whole again, so a wait that timed out never
    leaves the barrier broken for the rounds after it (FastDeploy's cache messagers never
    reset a barrier). ``abort()`` breaks every round until ``reset()``, as
    ``threading.Barrier.abort`` does."""

    def __init__(self, parties):
        self.parties, self.gen, self.aborted = parties, 0, False
        self.arrived = 0  # in round gen
        self.ahead = collections.Counter()  # round > gen -> parties arrived for it early
        self.next_round = collections.OrderedDict()  # token -> its next round
        self.broken = set()  # rounds broken (those >= gen, and the last _BROKEN_MEMORY)

    def arrive(self, token):
        """Count ``token``'s next arrival; its round and its index in that round."""
        r = self.next_round.pop(token, self.gen)
        r = max(r, self.gen)  # a round that ended without it (reset, or forgotten)
        self.next_round[token] = r + 1
        if len(self.next_round) > _MAX_PARTIES:
            self.next_round.popitem(last=False)
        if r > self.gen:
            index = self.ahead[r]
            self.ahead[r] += 1
            return r, index
        index = self.arrived
        self.arrived += 1
        while self.arrived >= self.parties:  # round gen is whole: the next opens
            self._end_round()
        return r, index

    def _end_round(self):
        self.gen += 1
        self.arrived = self.ahead.pop(self.gen, 0)
        stale = self.gen - _BROKEN_MEMORY
        if len(self.broken) > _BROKEN_MEMORY:
            self.broken = {g for g in self.broken if g >= stale}

    def passed(self, r):
        """True once round ``r`` passed; ``BarrierBroken`` if it is broken (at once, not
        only once every party reached it); ``NotReady`` while it is open."""
        if self.aborted or r in self.broken:
            raise BarrierBroken
        if self.gen > r:
            return True
        raise NotReady

    def timed_out(self, r):
        """A waiter of round ``r`` gave up: the round is broken, unless it passed meanwhile
        (then True: the waiter passed after all)."""
        if self.gen > r and r not in self.broken:
            return True
        self.broken.add(r)
        return False

    def reset(self):
        """The open round ends broken (its waiters learn it); the next one is whole."""
        self.aborted = False
        self.broken.add(self.gen)
        self._end_round()
        while self.arrived >= self.parties:
            self._end_round()

    def state(self):
        return {"parties": self.parties, "broken": self.aborted or self.gen in self.broken,
                "n_waiting": 0 if self.gen in self.broken else self.arrived}


class _Group:
    """One DP group's channels. Flags are lists of 0/1 per client (TP rank)."""

    def __init__(self, n):
        self.cache_infos, self.info_read = [], [0] * n
        self.finished, self.finished_put, self.can_put_finished = [], [0] * n, 1
        self.added, self.added_put, self.can_put_added = [], [0] * n, 1
        self.disaggregated = collections.deque()
        self.rdma_tasks, self.rdma_read = [], [0] * n
        self.rdma_responses, self.rdma_put, self.can_put_rdma = [], [0] * n, 1
        self.barriers = {b: _Barrier(n) for b in BARRIERS}
        self.lock_holder = None


class ChannelState:
    """Every side channel of one server: ``local_data_parallel_size`` groups of
    ``num_client`` clients, and the server-wide prefill-instances queue.

    ``call(op, dp_id, client_id, arg)`` runs operation ``op`` (a method name below) and
    returns its result, or raises ``NotReady`` (FastDeploy would wait: ask again),
    ``BarrierBroken``, ``OverflowError`` (a channel is full) or ``ValueError`` (bad
    arguments). Lock invariant: ``_lock`` guards every field; each operation is one step
    under it, so two clients never see half of another's change. Never blocks beyond it."""

    def __init__(self, num_client, dp_size, info=None):
        self.num_client, self.dp_size = num_client, dp_size
        self._groups = [_Group(num_client) for _ in range(dp_size)]
        self._prefill = collections.deque()
        self._lock = threading.Lock()
        self._info = info or {}  # what "hello" answers
        self.connected = None  # callable(dp_id) -> int, set by the server
        self.engine_here = None  # callable(dp_id) -> bool, set by the server

    def call(self, op, dp_id, client_id, arg):
        if op not in OPERATIONS:
            raise ValueError(f"unknown side-channel operation {op!r}")
        if type(dp_id) is not int or not 0 <= dp_id < self.dp_size:
            raise ValueError(f"local_data_parallel_id={dp_id!r}: this server has "
                             f"{self.dp_size} DP group(s)")
        if type(client_id) is not int or not -1 <= client_id < self.num_client:
            raise ValueError(f"client_id={client_id!r}: this server has {self.num_client} "
                             f"client(s) per DP group")
        if op == "connected":  # asks the task queue, not the channels
            return self.connected(dp_id) if self.connected else 0
        if op == "engine_here":  # asks the server: a role hint (fastdeploy.queue)
            return bool(self.engine_here(dp_id)) if self.engine_here else False
        with self._lock:
            return getattr(_Ops, op)(self, self._groups[dp_id], client_id, arg)


def _bounded(items, what):
    if len(items) >= MAX_ITEMS:
        raise OverflowError(f"{what} holds {MAX_ITEMS} entries that nobody takes; not added "
                            f"(is the engine's side collecting them?)")


def _need_client(client_id, what):
    if client_id < 0:
        raise ValueError(f"{what} needs the caller's client_id (its TP rank), got -1")


class _Ops:
    """The operations ``ChannelState.call`` runs, with ``_lock`` held: ``(state, group,
    client_id, arg)``. Names are FastDeploy's where the operation is one of its methods."""

    @staticmethod
    def hello(state, g, client_id, arg):
        return dict(state._info, num_client=state.num_client, dp_size=state.dp_size)

    # -- cache infos: put waits until every client read the previous ones ----------------

    @staticmethod
    def put_cache_info(state, g, client_id, cache_info):
        if sum(g.info_read) < state.num_client:
            raise NotReady
        items = list(cache_info)
        if len(items) > MAX_ITEMS:
            raise OverflowError(f"put_cache_info: {len(items)} entries (at most {MAX_ITEMS})")
        g.cache_infos = items
        g.info_read = [0] * state.num_client

    @staticmethod
    def get_cache_info(state, g, client_id, arg):
        _need_client(client_id, "get_cache_info")
        if g.info_read[client_id] == 1:
            return []
        out = list(g.cache_infos)
        g.info_read[client_id] = 1
        if sum(g.info_read) == state.num_client:
            g.cache_infos = []
        return out

    @staticmethod
    def num_cache_infos(state, g, client_id, arg):
        return len(g.cache_infos)

    # -- finished requests (send-cache results): every client puts, the engine gets once all
    # did; a client's next put waits until then ---------------------------------------------

    @staticmethod
    def put_finished_req(state, g, client_id, send_cache_result):
        _need_client(client_id, "put_finished_req")
        if not g.can_put_finished:
            raise NotReady
        _bounded(g.finished, "put_finished_req")
        g.finished.append(send_cache_result[0])
        g.finished_put[client_id] = 1
        all_put = sum(g.finished_put) == state.num_client
        if all_put:
            g.can_put_finished = 0
        return all_put

    @staticmethod
    def get_finished_req(state, g, client_id, arg):
        if not g.finished:
            return []
        if sum(g.finished_put) < state.num_client:
            raise NotReady
        response = g.finished[0]
        for other in g.finished:  # any client's error wins
            if "error" in other[1]:
                response = _with_status(response, other[1])
        g.finished = []
        g.finished_put = [0] * state.num_client
        g.can_put_finished = 1
        return [response] if response else []

    # -- finished add-cache tasks: the same rule; every client reports the same ids -----------

    @staticmethod
    def put_finished_add_cache_task_req(state, g, client_id, req_ids):
        _need_client(client_id, "put_finished_add_cache_task_req")
        if not g.can_put_added:
            raise NotReady
        _bounded(g.added, "put_finished_add_cache_task_req")
        g.added.append(req_ids)
        g.added_put[client_id] = 1
        all_put = sum(g.added_put) == state.num_client
        if all_put:
            g.can_put_added = 0
        return all_put

    @staticmethod
    def get_finished_add_cache_task_req(state, g, client_id, arg):
        if not g.added:
            return []
        if sum(g.added_put) < state.num_client:
            raise NotReady
        response = g.added[0]
        if any(other != response for other in g.added):
            # FastDeploy asserts this; a differing report is logged, the first one returned
            log.error("get_finished_add_cache_task_req: the clients reported different "
                      "request ids (%d reports); returning the first", len(g.added))
        g.added = []
        g.added_put = [0] * state.num_client
        g.can_put_added = 1
        return response

    # -- disaggregated tasks: a queue; get drains it ----------------------------------------

    @staticmethod
    def put_disaggregated_tasks(state, g, client_id, item):
        _bounded(g.disaggregated, "put_disaggregated_tasks")
        g.disaggregated.append(item)

    @staticmethod
    def get_disaggregated_tasks(state, g, client_id, arg):
        if not g.disaggregated:
            return None
        items = list(g.disaggregated)
        g.disaggregated.clear()
        return items

    @staticmethod
    def disaggregate_queue_empty(state, g, client_id, arg):
        return not g.disaggregated

    # -- RDMA connect tasks: one at a time, read by every client -----------------------------

    @staticmethod
    def put_connect_rdma_task(state, g, client_id, task):
        if sum(g.rdma_read) < state.num_client:
            raise NotReady
        g.rdma_tasks = [task]
        g.rdma_read = [0] * state.num_client

    @staticmethod
    def get_connect_rdma_task(state, g, client_id, arg):
        _need_client(client_id, "get_connect_rdma_task")
        task = g.rdma_tasks[0] if g.rdma_tasks else None
        g.rdma_read[client_id] = 1
        all_read = sum(g.rdma_read) == state.num_client
        if all_read:
            g.rdma_tasks = []
        return task, all_read

    @staticmethod
    def put_connect_rdma_task_response(state, g, client_id, response):
        _need_client(client_id, "put_connect_rdma_task_response")
        if not g.can_put_rdma:
            raise NotReady
        _bounded(g.rdma_responses, "put_connect_rdma_task_response")
        g.rdma_responses.append(response)
        g.rdma_put[client_id] = 1
        all_put = sum(g.rdma_put) == state.num_client
        if all_put:
            g.can_put_rdma = 0
        return all_put

    @staticmethod
    def get_connect_rdma_task_response(state, g, client_id, arg):
        if not g.rdma_responses:
            return None
        if sum(g.rdma_put) < state.num_client:
            raise NotReady
        response = dict(g.rdma_responses[0])
        for other in g.rdma_responses:  # success only if every client succeeded
            response["success"] = response["success"] and other["success"]
        g.rdma_responses = []
        g.rdma_put = [0] * state.num_client
        g.can_put_rdma = 1
        return response

    # -- prefill instances: one queue for the server ----------------------------------------

    @staticmethod
    def prefill_put(state, g, client_id, item):
        _bounded(state._prefill, "available_prefill_instances")
        state._prefill.append(item)

    @staticmethod
    def prefill_get(state, g, client_id, arg):
        if not state._prefill:
            raise NotReady
        return state._prefill.popleft()

    @staticmethod
    def prefill_qsize(state, g, client_id, arg):
        return len(state._prefill)

    # -- barriers: (name, token) arrive -> (round, index); (name, round) poll -> passed? -----

    @staticmethod
    def barrier_arrive(state, g, client_id, arg):
        name, token = arg
        b = _barrier(g, name)
        if b.aborted:
            raise BarrierBroken
        return b.arrive(token)

    @staticmethod
    def barrier_poll(state, g, client_id, arg):
        name, r = arg
        return _barrier(g, name).passed(r)

    @staticmethod
    def barrier_abort(state, g, client_id, arg):
        """``(name, round)``: a waiter of ``round`` timed out: that round is broken unless
        it passed meanwhile (then True: the waiter passed). ``(name, None)``: ``abort()``."""
        name, r = arg
        b = _barrier(g, name)
        if r is None:
            b.aborted = True
            return False
        return b.timed_out(r)

    @staticmethod
    def barrier_reset(state, g, client_id, name):
        _barrier(g, name).reset()

    @staticmethod
    def barrier_state(state, g, client_id, name):
        return _barrier(g, name).state()

    # -- the DP group's lock: (token,) acquire -> True or NotReady ----------------------------

    @staticmethod
    def lock_acquire(state, g, client_id, token):
        if g.lock_holder is None:
            g.lock_holder = token
            return True
        raise NotReady

    @staticmethod
    def lock_release(state, g, client_id, token):
        if g.lock_holder is None:
            raise ValueError("release unlocked lock")
        g.lock_holder = None  # as threading.Lock: any holder of the proxy may release

    @staticmethod
    def lock_locked(state, g, client_id, arg):
        return g.lock_holder is not None


def _barrier(g, name):
    try:
        return g.barriers[name]
    except (KeyError, TypeError):
        raise ValueError(f"no barrier {name!r}; FastDeploy's are {', '.join(BARRIERS)}") from None


def _with_status(response, status):
    """``response`` with its second field set to ``status`` (FastDeploy assigns
    ``response[1]``; a tuple is rebuilt)."""
    if isinstance(response, list):
        response = list(response)
        response[1] = status
        return response
    return (response[0], status, *response[2:])


# Every operation ``ChannelState.call`` runs ("connected" asks the server's task queues,
# "engine_here" whether the server's process built an engine client for the DP group).
OPERATIONS = ("connected", "engine_here") + tuple(sorted(n for n in vars(_Ops)
                                                        if not n.startswith("_")))
