"""Profiling: the in-library step profiler, and the ``fastdeploy-sync profile`` benchmark.

``step_profiler``  StepProfiler: per-step critical-path times, fixed memory (production-safe)
``workload``       the simulated model steps (python / numpy / paddle / sleep) and batches
``loops``          the engine and worker processes: FastDeploy-shaped loops per mode
``runner``         starts the processes, runs interleaved segments, collects raw results
``report``         figures, the terminal table, JSON and the plot

Only ``StepProfiler`` is imported here: the benchmark's modules pull in tqdm/matplotlib
(and paddle for ``--step paddle``) when the command runs, never on ``import fastdeploy_sync``.
"""

from .step_profiler import StepProfiler

__all__ = ["StepProfiler"]
