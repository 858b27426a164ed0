"""Node-local shared memory: who owns a name (``ownership``), segments (``segment``: the one
helper that creates, attaches, proves ownership and reclaims), semaphores
(``semaphores``), and what lives in them: the engine's ack board (``ack_board``), the
worker group's batch ring (``batch_ring``), large batches and their pool (``payload``).
Every name is made by ``fastdeploy_sync.names``."""
