"""What a profile run is: its options (``ProfileOptions``), their checks and the schedule.

Light on purpose: it imports nothing of the library, nor paddle, torch, tqdm or
matplotlib, so that building ``fastdeploy-sync``'s parser costs nothing. ``validate()``
imports a GPU framework only when the run asks for the ``gpu`` step (to say at once, in one
line, when there is no GPU).

The schedule: ``rounds`` rounds, each of them::

    load         for every step kind (the order rotated by the round): every mode once,
                 ``steps / rounds`` steps each, the order rotated by the round; the reference
                 loop (no task sync) is one of the modes
    idle         every mode once, rate 0, ``idle_steps / rounds`` iterations (CPU while idle)

Interleaving short segments spreads machine drift (other tenants, thermal) over every mode
instead of charging it to whichever ran last, and makes each round a *pair*: the modes of
one round ran under the same conditions, so ``report`` compares them round by round and
bootstraps over rounds for its intervals.
"""

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ProfileOptions", "MODES", "REFERENCE", "STEP_KINDS", "TOKEN_KINDS",
           "DEFAULT_PLACEMENTS", "IDLE_WARMUP_STEPS", "default_step_kinds"]

MODES = ("async", "sync", "fd-manager")  # what is compared (the loops module runs them)
REFERENCE = "none"  # the same loop without task sync: the reference for inflation
STEP_KINDS = ("python", "numpy", "paddle", "gpu", "sleep")  # the workload module's steps
TOKEN_KINDS = ("numpy", "list")
# Process placements per run when --placements is not given (see the runner's docstring).
DEFAULT_PLACEMENTS = 2
# Idle iterations every rank runs, unmeasured, before an idle segment's window opens: the
# segment's client was built just before, and what its start-up leaves to the first
# iterations (the engine's welcome handled by the prefetch thread, the first barriers) is
# a worker's start-up cost, not its idle cost.
IDLE_WARMUP_STEPS = 20


def default_step_kinds() -> list:
    """``["python", "paddle"]``, or ``["python"]`` where paddle is not installed: the
    step that holds the GIL and the one that releases it. Looks paddle up without
    importing it."""
    return ["python", "paddle"] if importlib.util.find_spec("paddle") else ["python"]


@dataclass
class ProfileOptions:
    """The parameters of a run (all of them end up in the JSON)."""

    mode: str = "all"
    tp: int = 2
    step_kinds: Optional[list] = None  # None: default_step_kinds() (python, and paddle if installed)
    step_ms: float = 2.0
    rate: float = 100.0
    batch: int = 64
    prompt_len: int = 512
    tokens: str = "numpy"
    steps: int = 600  # load-phase steps per mode and step kind (split across the rounds)
    rounds: int = 10
    # blocks of rounds, each run by freshly started processes; None: 2 (1 for one round)
    placements: Optional[int] = None
    idle_steps: int = 600  # idle-phase iterations per mode (split across the rounds); 0: none
    max_inflight: int = 8
    cpus: Optional[list] = None  # [engine core, rank 0 core, ...] or None: not pinned
    # the gpu step's framework: auto, paddle, torch or MODULE:ATTR (gpu_step.resolve)
    gpu_backend: str = "auto"
    modes: list = field(default_factory=list)  # filled by validate()

    def validate(self) -> "ProfileOptions":
        """Raise ``ValueError`` naming the first bad option, in one line; fill ``modes``.
        With the ``gpu`` step kind, also checks that a GPU backend can run here
        (``gpu_step.resolve``, which imports paddle or torch)."""
        if self.mode == "all":
            self.modes = list(MODES)
        elif self.mode in MODES:
            self.modes = [self.mode]
        else:
            raise ValueError(f"--mode {self.mode!r}: expected all or one of {', '.join(MODES)}")
        if self.step_kinds is None:
            self.step_kinds = default_step_kinds()
        if self.placements is None:
            self.placements = min(DEFAULT_PLACEMENTS, max(1, self.rounds))
        unknown = [k for k in self.step_kinds if k not in STEP_KINDS]
        checks = [
            (bool(self.step_kinds) and not unknown and
             len(set(self.step_kinds)) == len(self.step_kinds),
             f"--step {','.join(self.step_kinds)}: expected one or more of "
             f"{', '.join(STEP_KINDS)}, comma-separated, each once"),
            (self.tokens in TOKEN_KINDS, f"--tokens {self.tokens!r}: expected one of {', '.join(TOKEN_KINDS)}"),
            (1 <= self.tp <= 16, f"--tp {self.tp}: expected 1..16"),
            (self.step_ms > 0, f"--step-ms {self.step_ms}: expected > 0"),
            (self.rate >= 0, f"--rate {self.rate}: expected >= 0"),
            (self.batch >= 1, f"--batch {self.batch}: expected >= 1"),
            (self.prompt_len >= 1, f"--prompt-len {self.prompt_len}: expected >= 1"),
            (self.rounds >= 1, f"--rounds {self.rounds}: expected >= 1"),
            (1 <= self.placements <= self.rounds,
             f"--placements {self.placements}: expected 1..--rounds ({self.rounds})"),
            (self.steps >= self.rounds, f"--steps {self.steps}: expected >= --rounds ({self.rounds})"),
            (self.idle_steps == 0 or self.idle_steps >= self.rounds,
             f"--idle-steps {self.idle_steps}: expected 0 or >= --rounds ({self.rounds})"),
            (self.max_inflight >= 1, f"--max-inflight {self.max_inflight}: expected >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if "paddle" in self.step_kinds and importlib.util.find_spec("paddle") is None:
            raise ValueError("--step paddle: paddlepaddle is not installed (pip install "
                             "paddlepaddle, or the package's test extra)")
        if self.cpus is not None:
            allowed = sorted(os.sched_getaffinity(0))
            if len(self.cpus) != self.tp + 1:
                raise ValueError(f"--cpus {','.join(map(str, self.cpus))}: expected {self.tp + 1} "
                                 f"cores (the engine, then one per rank of --tp {self.tp})")
            bad = [c for c in self.cpus if c not in allowed]
            if bad:
                raise ValueError(f"--cpus: core {bad[0]} is not available to this process "
                                 f"(available: {','.join(map(str, allowed))})")
        if "gpu" in self.step_kinds:
            from .gpu_step import GpuUnavailable, resolve

            try:
                resolve(self.gpu_backend)
            except GpuUnavailable as exc:
                raise ValueError(f"--step gpu: {exc}") from None
        return self

    def cores(self) -> list:
        """The cores the run's processes may use: the distinct ``cpus`` when pinned, else
        this process's affinity (``os.sched_getaffinity``), which its children inherit."""
        if self.cpus is not None:
            return sorted(set(self.cpus))
        return sorted(os.sched_getaffinity(0))

    def schedule(self):
        """[(mode, step kind, phase, round, steps)] in run order (step kind None: idle)."""
        modes = [REFERENCE] + self.modes
        per_round, idle_per_round = self.steps // self.rounds, self.idle_steps // self.rounds
        out = []
        for r in range(self.rounds):
            for kind in _rotated(self.step_kinds, r):
                out += [(m, kind, "load", r, per_round) for m in _rotated(modes, r)]
            if idle_per_round:
                out += [(m, None, "idle", r, idle_per_round) for m in _rotated(modes, r)]
        return out


def _rotated(items, r):
    k = r % len(items)
    return list(items[k:]) + list(items[:k])
