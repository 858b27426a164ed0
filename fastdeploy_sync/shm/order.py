"""Memory order for what processes publish to each other through shared memory.

Every protocol here publishes the same way: a writer stores some words (a descriptor, a
decision, a batch's bytes), then one word that says they are there (PUBLISHED, a SEQ, an
ARRIVED generation, a READY flag, a release stamp); a reader loads that word and, if it
says so, the rest. That is only correct if the reader cannot see the flag before the words
it publishes. x86-64 keeps store->store and load->load order, so plain stores happened
to be enough there; aarch64 (and POWER) reorder both, so a rank could read a PUBLISHED
word or an arrival and then the descriptor or decision of before. Python has no atomics
and no fence, so every publication goes through this module:

* ``store_release(words, i, value)``: a full fence, then the store. Every store and load
  before it is visible to whoever sees ``value``.
* ``load_acquire(words, i)``: the load, then a full fence. Whatever was published before
  the value it returns is visible to every load after it.
* ``fence()``: the fence alone, for a hot path that reads a word plainly and fences only
  when the word says something new (``exist_tasks()``'s one read finds nothing new on
  almost every step), and for a writer that publishes several words behind one fence.

The fence, and why it is one (the argument names no single architecture): a
``threading.Lock`` acquire is an atomic read-modify-write with acquire semantics and its
release one with release semantics (CPython's lock is a POSIX semaphore or mutex: glibc's
``sem_trywait``/``sem_post``, ``pthread_mutex_lock``/``unlock``). ``fence()`` does
acquire, release, acquire, release, and what orders is the middle: a release followed in
program order by an acquire. Every access before the fence is ordered before that
release (release semantics), and every access after the fence after that acquire
(acquire semantics). For store->store and load->load that is enough on every memory model
CPython runs on (a release is ordered before later stores by the barrier it carries:
x86-64 ``lock``-prefixed instructions are full barriers, POWER's release is ``lwsync``,
which orders every earlier store before every later one and every earlier load before
every later one); for store->load it also needs the release ordered before the later
acquire, which holds where release/acquire are RCsc (x86-64; aarch64, whose
``stlxr``/``casl`` followed by ``ldaxr``/``casa`` is ordered), not on POWER. One
acquire/release pair would not do: the earlier and the later accesses could both move in
between its acquire and its release and then pass each other (vLLM's ``shm_broadcast``
uses one pair). The outer acquire and release only make the inner pair legal on a shared
lock; a fence that finds the lock held (another thread is in its own fence) waits a few
instructions for it.

An aligned 8-byte store of a ``memoryview`` cast to ``"q"`` is one store instruction on
every 64-bit architecture CPython runs on, so a reader never sees half a word.

Cost: two uncontended lock round trips (docs/performance.md has the figure); a rank's idle
step pays none (``fence()`` only after a new value), a barrier two, a batch a few.

What the protocols do not rely on: store->load order across processes (Dekker: "I sleep"
vs "you arrived" needs it on *both* sides, and x86-64 does not give it with plain stores
either). The protocols that have such a pair (``tp.shm_group``) keep a bounded fallback
(semaphore waits time out and re-check) instead of paying a fence on every step.
"""

import threading

__all__ = ["fence", "store_release", "load_acquire"]

_LOCK = threading.Lock()
_acquire, _release = _LOCK.acquire, _LOCK.release


def fence() -> None:
    """A full memory fence (see the module docstring). Never blocks beyond another
    thread's fence; releases no GIL."""
    _acquire()
    _release()  # ordered before the next acquire: the fence
    _acquire()
    _release()


def store_release(words, index: int, value: int) -> None:
    """``words[index] = value`` after every earlier store and load of this thread is
    visible (a fence, then the store)."""
    _acquire()
    _release()
    _acquire()
    _release()
    words[index] = value


def load_acquire(words, index: int) -> int:
    """``words[index]``, loaded before every later load and store of this thread (the load,
    then a fence)."""
    value = words[index]
    _acquire()
    _release()
    _acquire()
    _release()
    return value
