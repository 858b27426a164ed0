"""The engine side: ``TaskQueue`` (``queue``) and what it is made of: the ledger of batches
in flight, the I/O thread, worker-group membership, the producer endpoint and
``TaskProducer``, the put path's encoder, the flood guards, and ``query_status``."""
