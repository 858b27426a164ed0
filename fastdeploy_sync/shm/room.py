"""Room in ``/dev/shm``: how much a pool, a large batch or a ring may take of it now.

Shared memory is an optimisation: a batch never waits or fails for want of it (it takes
another path), and neither path may leave less than a quarter of ``/dev/shm`` free for the
rest of the node (NCCL, other processes); a pool takes at most half of it.
"""

import os

from ..names import SHM_DIR as _SHM_DIR

__all__ = ["shm_room", "pool_size", "fresh_fits", "MiB"]

MiB = 1 << 20


def shm_room(path: str = _SHM_DIR):
    """``(size, free)`` of the filesystem holding ``path``, in bytes (one statvfs)."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _reserve_left(total: int) -> int:
    # what the payload paths leave free for the rest of the node
    return total // 4


def pool_size(requested: int, min_bytes: int, path: str = _SHM_DIR):
    """``(bytes, why)``: how big a pool of ``requested`` data bytes may be in ``path`` now,
    rounded down to MiB; 0 when it would be smaller than ``min_bytes``. ``why`` says what
    limited it (None: nothing did)."""
    total, free = shm_room(path)
    limits = [(requested, None),
              (total // 2, f"half of {path} ({total // MiB} MiB)"),
              (free - _reserve_left(total), f"{path} has {free // MiB} MiB free of "
                                            f"{total // MiB} MiB and the pool leaves a "
                                            f"quarter of it free")]
    size, why = min(limits, key=lambda limit: limit[0])
    size = max(0, size) // MiB * MiB
    if size < min_bytes:
        return 0, (f"{why}: " if why else "") + (f"{size // MiB} MiB is less than the "
                                                 f"{-(-min_bytes // MiB)} MiB a pool needs")
    return size, why


def fresh_fits(size: int, path: str = _SHM_DIR):
    """``None`` if a segment of ``size`` bytes leaves a quarter of ``path`` free, else a
    sentence saying why it does not."""
    total, free = shm_room(path)
    if free - size >= _reserve_left(total):
        return None
    return (f"{path} has {free // MiB} MiB free of {total // MiB} MiB: a {size / MiB:.1f} MiB "
            f"segment would leave less than a quarter of it free")
