"""How the TP ranks of one worker group agree on each step. Modules:

``protocol``       what a TP group is to a ``TaskClient``: ``TPGroup``, ``WaitHooks``
``shm_group``      the node-local group: watermarks, step decisions, the spin-then-block barrier
``group_segment``  that group's shared memory and semaphores: made, joined, freed without waiters
``layout``         the group segment's layout, and a read-only look at a live one (``status``)
``spin``           how long a waiting rank spins before it blocks
``peers``          what a waiting rank knows of its peers: stopped, left, died
``solo``           the TP=1 group: nothing to agree on
``paddle_group``   the across-nodes group over paddle.distributed
``factory``        which group a rank joins (``make_group``)
``barrier``        ``ShmBarrier``: the node-local barrier alone, public, for loops of one's own

Public here: ``ShmBarrier``.
"""

from .barrier import ShmBarrier

__all__ = ["ShmBarrier"]
