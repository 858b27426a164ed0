"""What other processes took of the run's cores while a segment ran.

The profile compares modes measured one after another; a job that starts or stops on the
same cores between two of them moves every figure, and on a shared 2-core machine it can
turn a ratio of 12x into 3x. The run-queue figures say how long rank 0 waited for a core,
not who took it. This module says who: the CPU time the cores spent busy (``/proc/stat``,
the run's cores only) minus the CPU time of the run's own processes (the runner and every
process below it, ``/proc/<pid>/stat``), over the segment's wall time, in cores. Steal
time (a hypervisor giving the core to another machine) counts as taken.

Linux only: elsewhere ``snapshot()`` returns None and the report says the load is unknown.
Reading costs a scan of ``/proc`` (a few ms), made before and after each segment's
measured steps, never during them.
"""

import os
import time
from collections.abc import Iterable
from typing import NamedTuple, Optional

__all__ = ["Snapshot", "snapshot", "foreign_cores", "summarize", "withhold_verdicts",
           "LIMIT_PCT"]

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Snapshot(NamedTuple):
    """CPU jiffies at one moment: ``busy`` of the run's cores, ``ours`` of the run's
    processes, and the monotonic time they were read at."""

    busy: int
    ours: int
    at: float


def _busy_jiffies(cores: Iterable[int]) -> int:
    """Busy jiffies of ``cores`` since boot: user, nice, system, irq, softirq and steal
    (idle and iowait are not busy)."""
    wanted = {f"cpu{c}" for c in cores}
    total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            fields = line.split()
            if fields[0] in wanted:
                user, nice, system, _idle, _iowait, irq, softirq, steal = \
                    (int(x) for x in fields[1:9])
                total += user + nice + system + irq + softirq + steal
    return total


def _tree_jiffies(root: int) -> int:
    """User + system jiffies of ``root`` and every live process below it (all threads).
    A process that exits between the directory scan and its read is skipped."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                raw = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: split after its end
        fields = raw[raw.rfind(")") + 2:].split()
        pid = int(entry)
        parent[pid] = int(fields[1])
        cpu[pid] = int(fields[11]) + int(fields[12])
    children: dict = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def snapshot(cores: Iterable[int], root: Optional[int] = None) -> Optional[Snapshot]:
    """Read the cores' busy time and the CPU time of ``root``'s process tree (default: this
    process's). None where ``/proc`` cannot be read (not Linux)."""
    try:
        return Snapshot(_busy_jiffies(cores), _tree_jiffies(os.getpid() if root is None
                                                             else root), time.monotonic())
    except (OSError, ValueError, IndexError):
        return None


def foreign_cores(before: Optional[Snapshot], after: Optional[Snapshot]) -> Optional[float]:
    """Cores' worth of CPU that processes outside the run took between the two snapshots
    (0 or more; None when either is missing or no time passed). Resolution: one jiffy
    (``1 / SC_CLK_TCK`` s) per core and snapshot, so segments shorter than a few hundred ms
    read coarsely."""
    if before is None or after is None or after.at <= before.at:
        return None
    taken = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, taken / _HZ / (after.at - before.at))


#: Above this share of the run's cores taken by other processes (the mean over the rounds),
#: the run is not comparable: its met and MISSED verdicts become inconclusive.
LIMIT_PCT = 10.0


def summarize(segments, rounds: int) -> dict:
    """Per round, the share of the run's cores other processes took (% of the cores, the
    mean over the round's segments; None where unknown), their mean and max, the rounds
    above ``LIMIT_PCT``, whether the run is ``contended`` (the mean above it) and ``line``,
    what the terminal prints."""
    per_round = []
    cores = None
    for r in range(rounds):
        values = [s["foreign_cores"] for s in segments
                  if s["round"] == r and s.get("foreign_cores") is not None]
        cores = cores or next((s.get("cores") for s in segments if s.get("cores")), None)
        per_round.append(100.0 * sum(values) / len(values) / cores if values and cores
                         else None)
    known = [v for v in per_round if v is not None]
    if not known:
        return {"per_round_pct": per_round, "mean_pct": None, "max_pct": None,
                "rounds_above": None, "limit_pct": LIMIT_PCT, "contended": False,
                "line": "other processes' share of the cores: unknown (no /proc here)"}
    mean, top = sum(known) / len(known), max(known)
    above = sum(v > LIMIT_PCT for v in known)
    contended = mean > LIMIT_PCT
    line = (f"other processes took {mean:.1f} % of the run's {cores} cores (mean over "
            f"{len(known)} rounds; {top:.1f} % in the busiest; {above} above {LIMIT_PCT:g} %)")
    if contended:
        line += (": the run is not comparable, so no target is judged met or MISSED; "
                 "run it again on a quieter machine")
    return {"per_round_pct": per_round, "mean_pct": mean, "max_pct": top,
            "rounds_above": above, "limit_pct": LIMIT_PCT, "contended": contended,
            "line": line}


def withhold_verdicts(summary: dict, targets: list) -> None:
    """When ``summary`` says the run was contended, make every met or MISSED target row
    inconclusive, with the reason (in place). Otherwise leave them as they are."""
    if not summary["contended"]:
        return
    reason = (f"contended: other processes took {summary['mean_pct']:.1f} % of the cores "
              f"(more than {LIMIT_PCT:g} %)")
    for row in targets:
        if row["verdict"] in ("met", "MISSED"):
            row.update(verdict="inconclusive", met=None,
                       reason=reason if not row.get("reason") else
                       f"{row['reason']}; {reason}")
