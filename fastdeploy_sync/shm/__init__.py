"""Node-local shared memory. Every name is made by ``fastdeploy_sync.names``. Modules:

``ownership``     who owns a name in ``/dev/shm``: owner locks, own-uid checks, fork
``segment``       ``Segment``: the one way a segment is created, attached, proven owned, reclaimed;
                  ``map_shared``: the one way memory is mapped
``semaphores``    named semaphores: created 0600, owner-checked, waited on through signals
``order``         release stores and acquire loads: every publication between processes
``header``        a segment's MAGIC, VERSION and READY: written last, checked first
``sealed``        memory nobody can shrink: a sealed memfd found through a named anchor
``memfd_server``  this process's sealed memfds, handed over a unix socket to another pid namespace
``room``          what ``/dev/shm`` may give a pool, a large batch or a ring now
``ack_board``     the engine's ack board: what each rank consumed
``batch_ring``    the worker group's batch ring: one write per node, every rank reads
``payload``       large batches copied once per node: out-of-band buffers in shared memory
``pool``          the engine's pool of reused shared memory for large batches
``release``       a rank's release of a batch's memory, published when its last view is freed
"""
