"""TP coordination across nodes over paddle.distributed (no home-made consensus).

When the ranks of one TP group sit on several nodes, the node-local shared memory of
``tp.shm_group.ShmTPGroup`` cannot reach them. This coordinator replaces the shared-memory
barrier with one collective per step: ``all_reduce(MIN)`` of a two-int64 tensor
``[offer, consumed]`` over the TP ranks' paddle.distributed group.

  * rank 0 offers what its ``exist_tasks()`` latched for this step (its own received
    watermark), or what it has already taken when it latched nothing ("take nothing");
  * every other rank offers its own received watermark.

The minimum is a seq that every rank already holds, and every rank computes the same
decision "take (consumed, min]" from the same reduced tensor: the step-consistency
invariant holds by construction. The collective is also the step's barrier.

Differences from the node-local group, all inherent to having no shared memory:
  * ``exist_tasks()`` on rank 0 says "rank 0 holds new batches"; whether every rank holds
    them is only known at the barrier (the step may then take fewer, or none).
  * ``read_finished`` is derived from the consumed watermarks reduced at the barrier, so
    it reports the previous step's takes: it lags one step.

Failures and time bounds (paddle 3.3.1, gloo backend on CPU):
  * gloo's collectives time out after gloo's default **30 s** (``GLOO_TIMEOUT_S``), and
    paddle gives no way to change that for a gloo process group: ``new_group(timeout=...)``
    only bounds store operations, ``PADDLE_PG_TIMEOUT`` only reaches NCCL/FlagCX groups,
    and ``ProcessGroupGloo``/``GlooCommContext`` never call gloo's ``setTimeout``.
  * So ``barrier(timeout)`` with ``timeout < GLOO_TIMEOUT_S`` runs the all-reduce on a
    helper thread (paddle releases the GIL inside it) and stops waiting after
    ``timeout``; the hand-off costs little next to the all-reduce itself
    (docs/across-nodes.md). ``timeout=None`` or ``>= GLOO_TIMEOUT_S``
    runs it inline, bounded by gloo's 30 s. The constructor's collective is bounded by
    gloo's 30 s too: every rank must build its group within 30 s of the others.
  * A rank whose process dies while its node stays up (killed, crashed) has its TCP
    connections reset by its kernel: the peers learn it within milliseconds
    (docs/across-nodes.md) and raise ``PeerLostError``. A rank that is alive but silent (stopped,
    stuck, node powered off, network partition) is only detected by the timeout:
    ``BarrierTimeoutError``.
  * Both messages name this TP rank, its node (hostname and paddle endpoint) and the
    peer's TP rank and paddle endpoint (from gloo's ``pair_rank``, else from the IP in
    its message, else every other rank); gloo's exception, when there is one, is chained
    (a timeout of the helper thread's wait has none).
  * After either error the group is unusable (gloo leaves a collective half done, and the
    abandoned one may still complete on the peers): every later ``barrier()`` raises
    again. Restart every rank of the TP group; ``incarnation`` tells the new group from
    the old one.

paddle is imported here only, when this coordinator is built: ``import fastdeploy_sync``
never imports it. The caller owns paddle.distributed: call ``init_parallel_env()`` (or
fleet's init) before building a TaskClient with ``coordinator="paddle"``.
"""

import hashlib
import os
import queue
import re
import secrets
import socket
import threading
import time
from typing import Optional

import numpy as np

from ..errors import BarrierTimeoutError, TaskSyncError
from .protocol import NO_HOOKS

__all__ = ["PaddleTPGroup", "PeerLostError", "GLOO_TIMEOUT_S", "node_identity",
           "paddle_initialized", "locate_tp_group"]

# gloo's kTimeoutDefault: what every collective of a paddle gloo process group waits for.
GLOO_TIMEOUT_S = 30.0
# wait_received polls this rank's receipt this often (nothing posts across nodes).
_POLL_S = 0.001

# gloo's messages name the peer as "pair_rank = N" (its rank in the group, -1 if unknown)
# and/or as "[ip]:port" (the peer's gloo listening port, not its paddle endpoint).
_PAIR_RANK = re.compile(r"pair_rank\s*=\s*(-?\d+)")
_PEER_ADDR = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_CONNECTION_LOST = re.compile(r"reset by peer|closed by peer|connection closed|broken pipe|"
                              r"connection refused|read error|write error|EOF", re.I)


def node_identity() -> int:
    """A 63-bit id equal for exactly the processes that can share POSIX shared memory: this
    boot of this kernel (``boot_id``) and this ``/dev/shm`` mount (device and inode), so
    containers or mount namespaces with their own ``/dev/shm`` on one host count as
    different nodes, as they must for node-local coordination. Reads two files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "none"
    digest = hashlib.blake2b(f"{boot}|{shm}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def paddle_initialized() -> bool:
    """True when this process has already imported paddle and initialised
    paddle.distributed (never imports paddle itself)."""
    import sys

    dist = sys.modules.get("paddle.distributed")
    try:
        return dist is not None and bool(dist.is_initialized())
    except Exception:  # an older paddle without is_initialized()
        return False


def locate_tp_group(key: int, tp_size: int, tp_rank: int, force: bool = False):
    """Find this TP group among the paddle.distributed world and say whether it spans nodes.

    A collective over the whole world: every rank of it must call this, in the same order
    (FastDeploy's workers build their task queue together at start-up). Each rank gives
    ``key`` (equal for the ranks of one TP group, e.g. derived from the queue's address
    and DP group), its ``tp_rank`` and its ``node_identity()``; one
    ``paddle.distributed.all_gather`` tells every rank everything.

    Returns ``(coordinator, spans_nodes)``: ``coordinator`` is None when every rank of
    this group shares this node and ``force`` is False (node-local shared memory will do),
    else ``"paddle"`` when the group is the whole world, else the paddle group of its ranks
    (``new_group``, called by every rank for every such group in one order). Raises
    ``ValueError`` naming the ranks when the world does not hold exactly ``tp_size``
    ranks 0..tp_size-1 for ``key``. Bounded by gloo's 30 s."""
    import paddle
    import paddle.distributed as dist

    world = dist.get_world_size()
    me = paddle.to_tensor([key, tp_rank, node_identity(), int(force)], dtype="int64")
    gathered: list = []
    dist.all_gather(gathered, me)
    rows = [tuple(int(x) for x in t.numpy()) for t in gathered]
    groups: dict = {}
    for world_rank, (k, r, node, forced) in enumerate(rows):
        groups.setdefault(k, []).append((r, world_rank, node, forced))
    mine = sorted(groups[key])
    if [r for r, _, _, _ in mine] != list(range(tp_size)):
        raise ValueError(f"TP rank {tp_rank}: the paddle.distributed world ({world} ranks) "
                         f"holds TP ranks {[r for r, _, _, _ in mine]} of this queue and DP "
                         f"group, expected 0..{tp_size - 1}: is num_client (tp size) the "
                         f"same on every rank, and each client_id used once?")
    needs_paddle = {}
    for k, members in groups.items():
        members.sort()
        spans = len({node for _, _, node, _ in members}) > 1
        if spans or any(f for _, _, _, f in members):
            needs_paddle[k] = (spans, [w for _, w, _, _ in members])
    coordinator = None
    for k in sorted(needs_paddle):  # every rank creates every such group, in one order
        if len(needs_paddle[k][1]) == world:
            continue
        group = dist.new_group(ranks=needs_paddle[k][1])
        if k == key:
            coordinator = group
    if key not in needs_paddle:
        return None, False
    spans = needs_paddle[key][0]
    if len(mine) == world:
        return "paddle", spans
    if dist.get_rank(coordinator) != tp_rank:
        raise ValueError(f"TP rank {tp_rank}: paddle placed this process at rank "
                         f"{dist.get_rank(coordinator)} of its TP group")
    return coordinator, spans


class PeerLostError(BarrierTimeoutError):
    """A rank of a paddle-coordinated TP group died or its connection was reset while this
    rank waited in the group's collective; the message names both ranks and their nodes.

    A subclass of ``BarrierTimeoutError`` because the node-local group raises that when a
    rank exits: one ``except BarrierTimeoutError`` covers both coordinators."""


class PaddleTPGroup:
    """One rank's handle on a TP group coordinated by paddle.distributed collectives.

    ``group``: the paddle.distributed communication group of the TP ranks (None = the
    default, whole-world group); the rank's position in it must equal ``tp_rank``.

    The constructor runs one collective (all ranks must construct the group within
    ``GLOO_TIMEOUT_S`` of each other) that agrees on ``incarnation``: a random non-zero
    63-bit int chosen by rank 0, identical on every rank, different for every construction.
    Raises ``PeerLostError``/``BarrierTimeoutError`` as ``barrier()`` does.

    ``track_consumed=False`` reduces the offer alone (one int64 instead of two: a cheaper
    collective) for a caller that does not use ``all_consumed()`` (it then always
    says False): the FastDeploy drop-in, whose ``all_client_read`` is decided otherwise.
    """

    spans_nodes = True

    def __init__(self, tp_size: int, tp_rank: int, group=None, track_consumed: bool = True):
        import paddle
        import paddle.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("coordinator='paddle' needs paddle.distributed initialized "
                               "first (paddle.distributed.init_parallel_env())")
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        if world != tp_size or rank != tp_rank:
            raise ValueError(f"paddle.distributed group has size {world} and this process is "
                             f"rank {rank} in it, but the TaskClient says tp_size={tp_size}, "
                             f"tp_rank={tp_rank}")
        self._paddle, self._dist, self._group = paddle, dist, group
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self._endpoints = _group_endpoints(dist, group, tp_size)
        self._node = f"{socket.gethostname()} (paddle endpoint {self._endpoints[tp_rank]})"
        self._broken = None  # the error that made this group unusable
        self._runner = None  # helper thread for collectives bounded below gloo's timeout
        self.gen = 0
        self._received = 0
        self._consumed = 0
        self._min_consumed = 0
        self._offer = None  # (gen, to) latched by rank 0's exist_tasks()
        self._decision = None  # (gen, from, to) reduced at the last barrier
        # rank 0 draws, the others contribute 0: MAX hands rank 0's draw to everyone
        mine = secrets.randbelow(2**63 - 1) + 1 if tp_rank == 0 else 0
        tensor = paddle.to_tensor([mine], dtype="int64")
        self._all_reduce(tensor, dist.ReduceOp.MAX, None, "building the group")
        self.incarnation = int(tensor.numpy()[0])
        # One tensor for every step, written and read through a numpy view of its memory:
        # gloo's all-reduce of a freshly made tensor costs about twice the collective itself
        # more than of a reused one (docs/across-nodes.md).
        self._track_consumed = bool(track_consumed)
        self._step_tensor = paddle.to_tensor([0, 0] if track_consumed else [0], dtype="int64")
        try:
            self._step_view: Optional[np.ndarray] = np.from_dlpack(self._step_tensor)
        except Exception:  # a paddle or numpy without DLPack: a fresh tensor per step
            self._step_view = None

    def publish_received(self, seq):
        self._received = seq

    def min_received(self):
        return self._received  # only this rank's: the others' are known at the barrier

    def wait_received(self, seq, timeout, check=None):
        """Until this rank holds ``seq`` (True) or ``timeout`` seconds pass (False): the
        others' receipts are known only at the barrier. Polls every ``_POLL_S`` (nothing
        posts across nodes); ``check`` runs after every poll."""
        deadline = time.monotonic() + timeout
        while self._received < seq:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, _POLL_S))
            if check is not None:
                check()
        return True

    def wait_peers(self, seq, timeout):
        return self._received  # the peers' receipts meet in the barrier's all-reduce

    def publish_engine(self, engine):
        pass  # each rank's engine speaks for it: the all-reduce takes what every rank holds

    def all_welcomed(self, engine):
        return True  # every rank offers what it can take: the all-reduce decides

    def engine_split(self, engine):
        return None

    def latch(self, gen, from_seq, to_seq):
        self._offer = (gen, to_seq)

    def decision(self, gen):
        d = self._decision
        if d is None or d[0] != gen:
            return None
        return d[1], d[2]

    def publish_consumed(self, seq):
        self._consumed = seq

    def all_consumed(self, seq):
        return self._track_consumed and self._min_consumed >= seq

    def barrier(self, timeout=None, hooks=NO_HOOKS):
        """One ``all_reduce(MIN)`` across the TP ranks; blocks until every rank joins it.

        ``timeout`` (seconds): the wait is bounded by ``min(timeout, GLOO_TIMEOUT_S)``;
        None means ``GLOO_TIMEOUT_S`` (30 s), not forever (gloo cannot wait longer).
        Raises ``BarrierTimeoutError`` when the bound passes, ``PeerLostError`` as soon as
        a rank's connection is reset (it died), both naming the ranks and nodes; after
        either, every call raises again (restart the TP group).

        ``hooks.check`` runs first (the worker raises its prefetch failure this way);
        ``hooks.service`` runs once before the offer is computed (sync mode receives what
        has arrived). ``hooks.on_wait`` is not called: gloo's wait has no hook of ours.
        """
        if hooks.check is not None:
            hooks.check()
        if hooks.service is not None:
            hooks.service()  # sync mode: receive what has arrived before offering it
        gen = self.gen + 1
        if self.tp_rank == 0:
            offer = self._offer[1] if self._offer and self._offer[0] == gen else self._consumed
        else:
            offer = self._received
        view = self._step_view
        if view is not None and not self._track_consumed:
            view[0] = offer
            self._all_reduce(self._step_tensor, self._dist.ReduceOp.MIN, timeout, "barrier", gen)
            upto = int(view[0])
        elif view is not None:
            view[0], view[1] = offer, self._consumed
            self._all_reduce(self._step_tensor, self._dist.ReduceOp.MIN, timeout, "barrier", gen)
            upto, self._min_consumed = int(view[0]), int(view[1])
        else:
            tensor = self._paddle.to_tensor([offer, self._consumed], dtype="int64")
            self._all_reduce(tensor, self._dist.ReduceOp.MIN, timeout, "barrier", gen)
            upto, self._min_consumed = (int(x) for x in tensor.numpy())
        # every rank has taken the same (consumed is equal everywhere), so "from" agrees
        self._decision = (gen, self._consumed, upto) if upto > self._consumed else None
        self.gen = gen

    def publish_fault(self, code):
        pass  # no shared memory across nodes: each rank learns from the engine itself

    def peer_fault(self):
        return None

    def missing_fault(self):
        return None

    def wake(self):
        pass

    def close(self, timeout=None):
        """Stop the helper thread (if any) once its collective ends. Never blocks."""
        if self._runner is not None:
            self._runner.stop()
            self._runner = None

    # -- the collective, bounded and in the library's terms ------------------------------

    def _all_reduce(self, tensor, op, timeout, what, gen=None):
        if gen is not None:
            what = f"{what} {gen}"
        if self._broken is not None:
            raise type(self._broken)(
                f"TP rank {self.tp_rank} on {self._node}: {what} refused: this paddle TP "
                f"group failed earlier ({self._broken}). Restart every rank of the TP "
                f"group.") from self._broken
        start = time.monotonic()

        def run():
            self._dist.all_reduce(tensor, op=op, group=self._group)

        try:
            if timeout is None or timeout >= GLOO_TIMEOUT_S:
                run()
            else:
                if self._runner is None:
                    self._runner = _CollectiveRunner(f"fdsync-paddle-tp{self.tp_rank}")
                if not self._runner.run(run, max(timeout, 0.0)):
                    self._broken = BarrierTimeoutError(
                        f"TP rank {self.tp_rank} on {self._node}: {what} timed out after "
                        f"{time.monotonic() - start:.2f}s (timeout={timeout}) waiting for "
                        f"{self._describe_peers(None)}: that rank is stuck or far behind, "
                        f"or the network between the nodes is down. Check those ranks' "
                        f"logs and the network, then restart every rank of the TP group.")
                    raise self._broken
        except TaskSyncError:
            raise
        except Exception as exc:  # gloo's errors reach Python as RuntimeError/OSError
            self._broken = self._translate(exc, what, time.monotonic() - start)
            raise self._broken from exc

    def _translate(self, exc, what, elapsed):
        text = str(exc)
        m = _PAIR_RANK.search(text)
        peer = int(m.group(1)) if m and 0 <= int(m.group(1)) < self.tp_size else None
        addr = _PEER_ADDR.search(text)
        if peer is None and addr is not None:
            on_host = [r for r, ep in enumerate(self._endpoints)
                       if r != self.tp_rank and ep.rpartition(":")[0] == addr.group(1)]
            peer = on_host[0] if len(on_host) == 1 else None
        gloo_addr = f", gloo peer {addr.group(1)}:{addr.group(2)}" if addr else ""
        who = self._describe_peers(peer) + gloo_addr
        # gloo labels a reset connection "TIMEOUT" too: a wait shorter than gloo's bound
        # cannot have timed out, so it is the connection that was lost
        lost = _CONNECTION_LOST.search(text) or elapsed < GLOO_TIMEOUT_S * 0.9
        if lost:
            return PeerLostError(
                f"TP rank {self.tp_rank} on {self._node}: {what} failed after {elapsed:.2f}s: "
                f"lost the connection to {who} (that rank's process died or its node "
                f"became unreachable). Check that rank's log; then restart every rank of "
                f"the TP group (gloo cannot rejoin a rank). gloo said: {text.strip()}")
        return BarrierTimeoutError(
            f"TP rank {self.tp_rank} on {self._node}: {what} timed out after {elapsed:.2f}s "
            f"(gloo's own {GLOO_TIMEOUT_S:.0f}s timeout, which paddle cannot change for a "
            f"gloo group) waiting for {who}: that rank is stuck or far behind, or the "
            f"network between the nodes is down. Check those ranks' logs and the network, "
            f"then restart every rank of the TP group. gloo said: {text.strip()}")

    def _describe_peers(self, peer):
        ranks = [peer] if peer is not None else [r for r in range(self.tp_size)
                                                  if r != self.tp_rank]
        named = ", ".join(f"TP rank {r} (paddle endpoint {self._endpoints[r]})" for r in ranks)
        return named if len(ranks) == 1 else f"one of {named}"


def _group_endpoints(dist, group, tp_size):
    """Each TP rank's paddle endpoint "ip:port" (or "?" where paddle does not say)."""
    env = dist.ParallelEnv()
    everyone = list(env.trainer_endpoints or []) or \
        [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    ranks = list(group.ranks) if group is not None else list(range(tp_size))
    return [everyone[r] if r < len(everyone) else "?" for r in ranks]


class _CollectiveRunner:
    """A daemon thread that runs one blocking collective at a time for a caller that waits
    with a timeout. A collective abandoned on timeout keeps the thread until gloo's own
    timeout ends it; the group is unusable by then anyway."""

    def __init__(self, name):
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn, timeout):
        """Run ``fn`` on the thread; True when it finished within ``timeout`` seconds
        (its exception, if any, is re-raised here), False when it is still running."""
        done, box = threading.Event(), []
        self._jobs.put((fn, done, box))
        if not done.wait(timeout):
            return False
        if box:
            raise box[0]
        return True

    def stop(self):
        self._jobs.put(None)  # ends the thread after the job in flight, if any

    def _loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done, box = job
            try:
                fn()
            except BaseException as exc:  # handed to the waiting caller
                box.append(exc)
            done.set()
