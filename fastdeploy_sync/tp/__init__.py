"""How the TP ranks of one worker group agree on each step: the interface every group
implements (``protocol``), the node-local shared-memory group (``shm_group``), the
across-nodes paddle.distributed group (``paddle_group``) and the TP=1 group (``solo``)."""
