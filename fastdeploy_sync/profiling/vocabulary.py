"""The profile's vocabulary: the JSON schema's name, the definition of every figure (the
terminal prints them, the JSON stores them, the plot's titles use the same phrases), and
what each step kind does with the GIL.

A *mode* (none, async, sync, fd-manager) is what is compared and only ever a row label; a
*step kind* (python, paddle, gpu, ...) is the simulated model step; the figures are the
*whole cost* per step (inflation and interruption, each against the FastDeploy-style queue),
the *critical path*, the *interruption* of the model step, the step-time *inflation*,
*delivery* and *idle CPU*.
"""

from .intervals import LEVEL, MIN_ROUNDS, RESAMPLES
from .options import IDLE_WARMUP_STEPS

__all__ = ["SCHEMA", "SCHEMA_CHANGES", "DEFINITIONS", "DELIVERY", "STEP_KIND_GIL",
           "HOLDS_GIL", "DELIVERY_PARTS", "DELIVERY_PART_WORDS"]

SCHEMA = "fastdeploy-sync-profile/3"

# What changed in each schema version (the JSON carries it; docs/profiling.md too).
SCHEMA_CHANGES = {
    "3": "new: headline (per step kind and mode: the whole cost per step, i.e. the step-time "
         "inflation and the interruption per step, each with its ratio to fd-manager's, and "
         "the critical path p50 as a detail), regime (cores, processes, threads, pinning, "
         "where the model step ran) and the gpu step kind (calibration: device, fixed_us); "
         "target rows carry regime (a note when the verdict depends on the cores, else "
         "null); reference_config is the name of the reference configuration the run "
         "matches (TP=2 or TP=8) or null, and targets_for names the configuration whose "
         "targets judged it; a cost ratio's interval may have an unbounded (null) upper end",
    "2": "two-stage intervals over process placements (parameters.placements, "
         "placement_pids)",
}

DELIVERY = "put_tasks() called -> the last rank's get_tasks() returned the batch"

# What each step kind does with the GIL: the delivery note and the plot say it.
STEP_KIND_GIL = {
    "python": "holds the GIL for the whole step (pure-Python work)",
    "numpy": "releases the GIL inside each numpy call",
    "paddle": "releases the GIL inside every paddle op, as GPU kernel launches do",
    "gpu": "launches a decode step's kernels on a GPU (each launch releases the GIL), then "
           "waits for the token ids on the host, as sampling does",
    "sleep": "sleeps: no CPU, no GIL",
}
HOLDS_GIL = {"python"}

# The delivery of a batch in three parts that add up to it (report's boundaries and parts).
DELIVERY_PARTS = ("to_first_boundary", "boundaries_passed", "taking_step")
DELIVERY_PART_WORDS = {"to_first_boundary": "put -> first boundary",
                       "boundaries_passed": "boundaries passed",
                       "taking_step": "the taking step"}

DEFINITIONS = {
    "round": "every mode once, back to back, under the same machine conditions (the "
             "modes' order rotates from round to round); the unit of evidence",
    "placement": "a block of consecutive rounds run by freshly started engine and worker "
                 "processes (--placements blocks per run): where the OS placed them, and "
                 "which rank came out faster, lasts as long as the processes",
    "interval": f"{LEVEL:.0%} percentile bootstrap, two-stage: the placements resampled with "
                f"replacement, then whole rounds within each ({RESAMPLES} resamples, "
                f"seeded); a figure comparing two modes uses the same resampled rounds for "
                f"both (paired); with one placement, a bootstrap over rounds",
    "verdict": f"met or MISSED only when the interval lies wholly on one side of the target, "
               f"otherwise inconclusive; fewer than {MIN_ROUNDS} rounds give no interval and "
               f"every verdict is inconclusive; the inflation is also inconclusive when the "
               f"model step ran faster than in none beyond its interval (task sync cannot "
               f"do that: the loops did not meet the same machine)",
    "step": "one iteration of rank 0's loop: check (exist_tasks), barrier, take (get_tasks), "
            "then the model step",
    "model_step": "the calibrated work of the step kind, then the model's TP collective "
                  "(a shared-memory barrier standing in for the all-reduce)",
    "critical_path": "check + barrier + take on rank 0's event loop, per step, as the "
                     "StepProfiler recorded them; the barrier part includes waiting for a "
                     "late rank",
    "inflation": "100 * (M - R) / R; M: the mode's mean step, R: none's (the same loop "
                 "without task sync), over the same rounds",
    "critical_path_share": "100 * C / R; C: the mode's mean critical path per step",
    "model_slowdown": "inflation - critical path share: the model step and its collective "
                      "ran slower than in none (CPU or GIL taken from them) or, negative, "
                      "faster (the barrier absorbed waiting that none spends in the "
                      "collective, or noise)",
    "off_cpu": "during the model step's work (not its collective), rank 0's event-loop "
               "thread: wall time minus the thread's own CPU time (time.thread_time_ns)",
    "run_queue": "part of off-CPU: runnable but not running, another thread or process had "
                 "the core (sched_info run_delay in /proc/self/task/<tid>/schedstat, ns)",
    "gil_wait": "time rank 0's event-loop thread waited for the GIL another thread of the "
                "process held during the model step's work (async: the prefetch thread; "
                "sync: the heartbeat thread; none: no other thread), as two bounds. Lower: "
                "the time it was blocked, i.e. off-CPU - run queue in steps where it switched "
                "out of its own accord (a voluntary context switch; the work does no I/O and "
                "takes no lock, so what it blocks on is the GIL). Upper: all off-CPU time of "
                "those steps (every GIL wait blocks at least once; a waiter that wakes to "
                "busy cores waits in the run queue). Close on an idle machine, apart under "
                "load. Resolution: a few us per step (the clocks are read one after "
                "another); checked against a thread holding the GIL for known times "
                "(scripts/tools/gil_wait_check.py); the meter's own cost is paid in every mode",
    "gil_wait_added": "100 * (G - G0) / R; G, G0: the mode's and none's mean GIL wait per "
                      "step, over the same rounds, for each bound; the target's interval runs "
                      "from the lower bound's low end to the upper bound's high end",
    "context_switches": "of the event-loop thread during the model step's work, per step "
                        "(getrusage RUSAGE_THREAD): involuntary = preempted, voluntary = "
                        "blocked (here: waiting for the GIL)",
    "delivery": DELIVERY + " (the engine stamps the batch just before put_tasks(), so a wait "
                           "for room counts)",
    "boundaries": "rank 0's step boundaries (checks) from put_tasks() to the take, the take's "
                  "included (1 = taken at the first boundary after the put): the share of "
                  "batches taken at the first, and the mean; batches taken in measured steps",
    "delivery_parts": "a batch's delivery in three parts that add up to it, means over the "
                      "batches taken in measured steps (ms): to_first_boundary (put_tasks() "
                      "called -> rank 0's first check after it), boundaries_passed (-> the "
                      "check of the step that took it), taking_step (-> the last rank's "
                      "get_tasks() returned it: the barrier waiting for the last rank, and "
                      "the take)",
    "loaded_cpu": "while the engine puts: the engine process (all threads) and a worker's "
                  "prefetch thread, % of one core",
    "idle_cpu": "rate 0 (nothing put; FastDeploy's loop sleeps 1 ms per iteration): worker "
                "process CPU (all threads) over wall time, max over ranks, % of one core; "
                "the prefetch thread's alone where there is one. Each segment opens its "
                f"window after {IDLE_WARMUP_STEPS} iterations, in every mode: the steady "
                "idle loop, without the start-up of the client the segment built",
    "idle_above_none": "the mode's idle worker CPU minus none's (the same 1 ms loop without "
                       "task sync) in the same rounds, percentage points",
    "ranks_agree": "in every segment every rank took the same batch ids at the same steps, "
                   "ids 0..put-1 in order (none lost, none twice)",
    "whole_cost": "what task sync costs rank 0's event loop per step, two ways, each beside "
                  "the FastDeploy-style queue (fd-manager) in the same rounds: the step-time "
                  "inflation (everything: the critical path, the GIL taken from the model "
                  "step, the cores other threads took) and the interruption per step; the "
                  "critical path p50 is a detail of it",
    "interruption_per_step": "C + G - G0 (us): the mode's mean critical path per step plus "
                             "the GIL wait it added to the model step's work (lower bound; "
                             "the upper bound's sum is interruption_upper_us)",
    "cost_ratio": "fd-manager's figure / the mode's, both over the same resampled rounds "
                  "('x lower'); a resample where the mode's figure is zero or negative (no "
                  "cost resolved) while fd-manager's is positive counts as an unbounded "
                  "ratio, so the interval's upper end can be unbounded (null in the JSON)",
    "regime": "the cores the run's processes may use (os.sched_getaffinity, or the --cpus "
              "pinning) against the processes started (the engine, the ranks, the "
              "fd-manager's server) and the threads they ran at the end of each mode's "
              "measured steps (Python threads; the kernel's count also holds libzmq's and "
              "the frameworks' threads); free cores: at least one per process and one per "
              "rank's background thread; shared cores: fewer cores than processes; and "
              "where the model step ran (the CPU, or which GPU)",
    "other_processes": "the share of the run's cores that processes outside the run took "
                       "during each segment's measured steps: the cores' busy time "
                       "(/proc/stat, steal included) minus the CPU time of the runner's "
                       "process tree, over the wall time; per round the mean over its "
                       "segments. Above 10 % on average the run is not comparable: no "
                       "target is judged met or MISSED (machine_load.others in the JSON)",
    "reference_configuration": "the configurations targets were set for: --step-ms 2 "
                               "--rate 100 --batch 64 --prompt-len 512 --tokens numpy at "
                               "--tp 2 or --tp 8, each with its own targets; any other run "
                               "is judged against the targets of the nearer one, indicative "
                               "only",
}
