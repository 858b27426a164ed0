"""The engine side: ``TaskQueue`` and what it is made of. Modules:

``queue``              ``TaskQueue``: the public API; construction unwound by an ``ExitStack``
``ledger``             the batches in flight, what each rank consumed, the window's room
``encoder``            the put path in one call: ``BatchEncoder.encode(tasks)``
``kept_batches``       what the engine keeps of a batch until every rank released it: the ring, pool, own segment
``io_loop``            the I/O thread: it owns the workers' and the producers' sockets
``outbox``             every send to a worker rank, never blocking
``membership``         worker groups: HELLO, WELCOME, pings, retirement (``GroupLost``)
``rank_link``          ``RankLink``: what the engine knows of one rank (state, silence, sent)
``producer_endpoint``  the queue's side of the producer endpoint
``producer``           ``TaskProducer``: other engine processes put through it
``flood_guard``        per-connection limits on what an authenticated peer can make it hold
``peer_log``           what the log says of peers, rate-limited per peer address
``status_reply``       ``StatusReply``: the queue's answer to STATUS (the asker: ``status_client``)
"""
