"""A rank's release of a batch's shared memory, published when the last view of it is freed.

Decoded arrays are zero-copy, read-only views of shared memory (a ring slot, a pool
region) that the engine writes again only once every rank released it. Every view of one
batch derives from one *holder* array; when the holder is garbage (so is every view), a
finalizer stores the batch's stamp in this rank's release word: one release store
(``shm.order``: every read of the batch's bytes is done before the engine can see it), in
whichever thread frees the last view. Two decodes of one batch (the prefetch thread's and
the event loop's) share one holder, so the release waits for both.

A process forked from a rank's holds copies of the rank's arrays, and frees them when it
drops them or exits: that is not the rank's release (the rank still reads the batch), so a
finalizer publishes nothing in a process forked after its holder was made (the fork
generation, ``_FORKS``, differs: a compare, no system call).
"""

import os
import threading
import weakref

from .order import fence, store_release

__all__ = ["Holders", "all_released"]


def all_released(words, first: int, stride: int, ranks: int, stamp: int) -> bool:
    """The engine's side of the rule "a slot or region is written again only once every
    rank released it": True when each of the ``ranks`` release words ``words[first + r *
    stride]`` holds ``stamp`` (the ring and the pool lay them out so); then a fence
    (acquire: every rank's reads of the batch's bytes happen before the caller's next
    write). Never blocks."""
    for index in range(first, first + ranks * stride, stride):
        if words[index] != stamp:
            return False
    fence()
    return True


class Holders:
    """The holders of one shared area's batches, by slot (ring) or entry (pool).

    ``words``: the int64 view whose word ``release_index`` receives the stamp. Thread-safe:
    ``holder`` may run in several threads at once, also for one batch."""

    def __init__(self, words):
        self._words = words
        self._held = {}  # key -> (stamp, weakref to the holder)
        self._lock = threading.Lock()

    def holder(self, key, stamp: int, make, release_index: int):
        """The holder of batch ``stamp`` at ``key``: the live one, or ``make()`` (an array
        every view of the batch must derive from), whose freeing publishes ``stamp`` at
        ``release_index``."""
        with self._lock:
            entry = self._held.get(key)
            holder = entry[1]() if entry is not None and entry[0] == stamp else None
            if holder is None:
                holder = make()
                # published only by the process that made the holder (module docstring)
                weakref.finalize(holder, _publish_release, self._words, release_index, stamp,
                                 _FORKS[0])
                self._held[key] = (stamp, weakref.ref(holder))
            return holder


def _publish_release(words, index, stamp, generation):
    if generation != _FORKS[0]:
        return  # freed in a forked child: the batch is still the parent's to release
    try:
        store_release(words, index, stamp)  # after every read of the batch's bytes
    except ValueError:  # the mapping's view was released (the process is shutting down)
        pass


# How many forks separate this process from the first that imported this module: a child
# made by os.fork() counts one more than its parent (os.register_at_fork).
_FORKS = [0]


def _after_fork_in_child():
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
