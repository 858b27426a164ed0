"""The ``fastdeploy-sync profile`` benchmark and the FastDeploy-style baseline it compares
against. The library never imports this package: ``import fastdeploy_sync`` and
``fastdeploy-sync``'s other commands load none of it; the ``profile`` command imports what
it runs. It needs the ``profile`` extra (``pip install 'fastdeploy_sync[profile]'``: tqdm
for the progress bar, matplotlib for ``--plot``) and runs without it, with no progress bar
and no plot; paddle or torch only for the step kinds that use them.

Imports run one way: ``command`` (the CLI) -> ``runner`` -> ``loops`` -> the library;
``report`` -> ``headline``, ``regime``, ``targets`` -> ``vocabulary``, ``intervals``,
``formatting``; ``plot`` and ``terminal`` read the summary ``report`` made.

``options``        ProfileOptions: what a run is (light: imports nothing heavy)
``command``        the ``profile`` subcommand's parser and what it runs
``fd_baseline``    FDManagerQueue: a stand-in for FastDeploy's EngineWorkerQueue
``workload``       the simulated model steps (python / numpy / paddle / gpu / sleep), batches
``gpu_step``       the gpu step: a transformer decode step through paddle or torch
``interruption``   ThreadInterruption: a thread's off-CPU time per step, split into run
                   queue, GIL wait and other, and its context switches
``loops``          the engine and worker processes: FastDeploy-shaped loops per mode
``runner``         starts the processes, runs paired interleaved rounds, collects raw results
``contention``     what other processes took of the run's cores while a segment ran
``intervals``      bootstrap intervals over rounds and the verdict words they allow
``report``         the figures (JSON-ready) from the raw results
``headline``       the whole cost per step, against the FastDeploy-style queue
``regime``         cores, processes, threads, where the step ran; the notes that depend on it
``targets``        the reference configurations (TP=2, TP=8), their targets, the verdicts
``vocabulary``     the schema version and the definition of every figure
``formatting``     how a figure is written in text
``terminal``       the terminal report
``plot``           the same figures as one PNG
"""
