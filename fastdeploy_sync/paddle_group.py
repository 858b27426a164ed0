"""TP coordination across nodes over paddle.distributed (no home-made consensus).

When the ranks of one TP group sit on several nodes, the node-local shared memory of
``tp_group.ShmTPGroup`` cannot reach them. This coordinator replaces the shared-memory
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
  * ``barrier(timeout=...)`` cannot interrupt a collective: the process group's own
    timeout applies (``FLAGS_...``/gloo timeout of your paddle.distributed set-up).

paddle is imported here only, when this coordinator is built: ``import fastdeploy_sync``
never imports it. The caller owns paddle.distributed: call ``init_parallel_env()`` (or
fleet's init) before building a TaskClient with ``coordinator="paddle"``.
"""

__all__ = ["PaddleTPGroup"]


class PaddleTPGroup:
    """One rank's handle on a TP group coordinated by paddle.distributed collectives.

    ``group``: the paddle.distributed communication group of the TP ranks (None = the
    default, whole-world group); the rank's position in it must equal ``tp_rank``.
    """

    def __init__(self, tp_size: int, tp_rank: int, group=None):
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
        self.gen = 0
        self._received = 0
        self._consumed = 0
        self._min_consumed = 0
        self._offer = None  # (gen, to) latched by rank 0's exist_tasks()
        self._decision = None  # (gen, from, to) reduced at the last barrier

    def publish_received(self, seq):
        self._received = seq

    def min_received(self):
        return self._received  # only this rank's: the others' are known at the barrier

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
        return self._min_consumed >= seq

    def barrier(self, timeout=None, service=None, check=None):
        """One ``all_reduce(MIN)`` across the TP ranks; blocks until every rank joins it.
        ``timeout`` is not enforced here (see the module docstring)."""
        if check is not None:
            check()
        if service is not None:
            service()  # sync mode: receive what has arrived before offering it
        gen = self.gen + 1
        if self.tp_rank == 0:
            offer = self._offer[1] if self._offer and self._offer[0] == gen else self._consumed
        else:
            offer = self._received
        tensor = self._paddle.to_tensor([offer, self._consumed], dtype="int64")
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)
        upto, self._min_consumed = (int(x) for x in tensor.numpy())
        # every rank has taken the same (consumed is equal everywhere), so "from" agrees
        self._decision = (gen, self._consumed, upto) if upto > self._consumed else None
        self.gen = gen

    def wake(self):
        pass

    def close(self):
        pass
