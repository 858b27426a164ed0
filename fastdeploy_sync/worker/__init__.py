"""The worker side: ``TaskClient``, one per TP rank, and what it is made of. Modules:

``client``         ``TaskClient``: the step API, used from the worker's event loop
``parts``          what a client is made of, and in which order (``assemble``)
``slot``           what the rank holds and has taken, between its threads
``connection``     the rank's sockets to its engine and every message it sends
``receiver``       what the rank receives from its engine, and who receives it
``background``     the background thread: the socket's receiver (async) or heartbeat (sync)
``ring_prefetch``  the batch ring on this rank and its prefetch thread
``engine_watch``   is the engine there? the rank's judgement of its engine
``faults``         what the next step call must raise; the fault protocol between ranks
``acks``           how the rank tells the engine what it has taken
``take``           taking a step's batches: from the slot, else decoded from the ring
``idle_wait``      rank 0's idle wait: no CPU until a step would take a batch
``step_profiler``  ``StepProfiler``: the step calls' critical-path time, step by step
"""
