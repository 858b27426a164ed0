"""Profiling: the ``fastdeploy-sync profile`` benchmark and the FastDeploy-style baseline.

``fd_baseline``    FDManagerQueue: a stand-in for FastDeploy's EngineWorkerQueue (benchmarks only)
``workload``       the simulated model steps (python / numpy / paddle / sleep) and batches
``interruption``   ThreadInterruption: a thread's off-CPU time per step, split into run
                   queue, GIL wait and other, and its context switches
``loops``          the engine and worker processes: FastDeploy-shaped loops per mode
``runner``         starts the processes, runs paired interleaved rounds, collects raw results
``intervals``      bootstrap intervals over rounds and the verdict words they allow
``report``         figures (JSON-ready) and the terminal report; their definitions
``plot``           the same figures as one PNG

The in-library StepProfiler lives in ``fastdeploy_sync.step_profiler`` (next to the
TaskClient it instruments); it is re-exported here for old imports, which costs nothing as
the TaskClient imports it anyway. Nothing else is imported here: the benchmark's modules pull
in tqdm/matplotlib (and paddle for ``--step paddle``) when the command runs, never on
``import fastdeploy_sync``.
"""

from ..step_profiler import StepProfiler

__all__ = ["StepProfiler"]
