"""The worker side: ``TaskClient`` (``client``), one per TP rank, and the collaborators it is
made of (the local slot, the engine connection and its receiver, the ring's prefetch
thread, the engine watch, the fault protocol), plus ``StepProfiler``."""
