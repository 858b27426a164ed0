"""Which TP group a rank joins: ``make_group``."""

from .. import envs
from .shm_group import ShmTPGroup
from .solo import SoloGroup

__all__ = ["make_group"]


def make_group(name: str, dp_id: int, tp_size: int, tp_rank: int, coordinator=None):
    """The group of rank ``tp_rank`` of ``tp_size`` (``tp.protocol.TPGroup``): TP=1 needs
    none (``SoloGroup``); else ``coordinator`` says which: ``"shm"`` (the ranks share a
    node), ``"paddle"`` (they span nodes: paddle.distributed's default group), a
    paddle.distributed group object (the TP ranks'), or an already built
    ``PaddleTPGroup``; None reads ``FD_SYNC_TP_COORDINATOR``. Paddle is imported only
    when asked for. ``ValueError`` for a string that names none of these."""
    if tp_size == 1:
        return SoloGroup()
    if coordinator is None:
        coordinator = envs.tp_coordinator()
    if coordinator == "shm":
        return ShmTPGroup(name, dp_id, tp_size, tp_rank)
    from .paddle_group import PaddleTPGroup  # imports paddle: only when asked for

    if coordinator == "paddle":
        return PaddleTPGroup(tp_size, tp_rank)
    if isinstance(coordinator, PaddleTPGroup):  # built by the caller (its own options)
        return coordinator
    if isinstance(coordinator, str):
        raise ValueError(f"coordinator={coordinator!r}: expected 'shm', 'paddle' or a "
                         f"paddle.distributed group")
    return PaddleTPGroup(tp_size, tp_rank, group=coordinator)
