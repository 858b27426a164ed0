"""Confidence intervals from paired, interleaved rounds, and the verdict words they allow.

A profile runs every mode once per *round*, the modes of a round back to back (``runner``).
Machine noise on a shared box moves whole rounds (another tenant starts a build, the
scheduler moves a process), so the unit of independent evidence is the round, not the
step: the steps of one round share its conditions. Each figure is therefore a statistic of
the rounds (the pooled p50 of their steps, a ratio of means, ...), and its interval comes
from a percentile bootstrap that resamples whole rounds with replacement. A figure that
compares two modes evaluates both on the *same* resampled rounds (paired), so a round in
which everything ran slow moves both sides together instead of widening the interval.

Some conditions last a whole process lifetime rather than a round: where the scheduler
placed the engine and the ranks relative to each other, which rank of a pair is the faster
one (and so always waits for the other). They moved a figure between runs of the same code
by more than its interval within one run (a ratio read 3.2x in one run and 6.5x in the
next, each interval excluding 5). So the runner splits the rounds into ``placements``
blocks, each run by freshly started processes, and the bootstrap is two-stage: it
resamples the placements with replacement, then rounds within each drawn placement. A
figure that differs between placements gets an interval spanning both, i.e. the verdict
says inconclusive where two runs would otherwise contradict each other.

Verdicts: ``met`` only when the whole interval lies on the good side of the threshold,
``MISSED`` only when it lies wholly on the bad side; otherwise ``inconclusive``. With fewer
than ``MIN_ROUNDS`` rounds there is no interval and every verdict is inconclusive. The
resampling is seeded: the same run gives the same intervals.
"""

from typing import Optional

import numpy as np

__all__ = ["Bootstrap", "placement_blocks", "verdict", "pooled_median", "pooled_mean",
           "ragged_median", "cost_ratio", "LEVEL", "RESAMPLES", "MIN_ROUNDS", "WORDS"]

LEVEL = 0.95
RESAMPLES = 2000
MIN_ROUNDS = 5  # a percentile bootstrap over fewer rounds has next to no resolution
_SEED = 20240617
_CHUNK = 250  # resamples evaluated at once (bounds the memory of a vectorised statistic)
WORDS = ("met", "MISSED", "inconclusive")


class Bootstrap:
    """Intervals over ``rounds`` rounds, run in ``placements`` blocks of consecutive rounds
    (``placement_blocks``) by separately started processes (1: one block, a plain bootstrap
    over rounds).

    A *statistic* is a function of an integer array ``idx`` of shape ``(n, rounds)``, each
    row a selection of round indices (with repetition), returning a float array ``(n,)``:
    the figure computed over the selected rounds. ``estimate(stat)`` evaluates it on every
    round once; ``interval(stat)`` on ``RESAMPLES`` resamples and returns the central
    ``LEVEL`` percentile interval, or None with fewer than ``MIN_ROUNDS`` rounds.
    Statistics that come back NaN in some resamples (a round without any sample) are
    judged on the others; all NaN gives None. A statistic may return +inf (``cost_ratio``:
    an unbounded ratio): ``estimate`` then gives None, and an interval end that falls on
    +inf is None, read as +inf (unbounded above).
    """

    def __init__(self, rounds: int, resamples: int = RESAMPLES, level: float = LEVEL,
                 seed: int = _SEED, placements: int = 1):
        if rounds < 1:
            raise ValueError(f"rounds={rounds}: expected >= 1")
        if not 1 <= placements <= rounds:
            raise ValueError(f"placements={placements}: expected 1..rounds ({rounds})")
        self.rounds, self.resamples, self.level = rounds, resamples, level
        self.placements = placements
        self.all_rounds = np.arange(rounds)[None, :]
        # One set of resamples for every statistic of the run: figures compared with each
        # other (a ratio and its parts, two step kinds) are judged on the same rounds.
        # Two stages, slot by slot of the run's blocks (so a resample has ``rounds``
        # rounds whatever the block sizes): which placement fills the slot (with
        # replacement), then that many of its rounds (with replacement).
        rng = np.random.default_rng(seed)
        blocks = placement_blocks(rounds, placements)
        starts = np.array([b[0] for b in blocks])
        sizes = np.array([len(b) for b in blocks])
        columns = []
        for slot_size in sizes:
            drawn = rng.integers(0, placements, size=(resamples, 1))
            offset = np.floor(rng.random((resamples, slot_size)) * sizes[drawn]).astype(int)
            columns.append(starts[drawn] + offset)
        self.idx = np.concatenate(columns, axis=1)

    @property
    def has_intervals(self) -> bool:
        return self.rounds >= MIN_ROUNDS

    def estimate(self, stat) -> Optional[float]:
        value = float(np.asarray(stat(self.all_rounds), dtype=float)[0])
        return None if not np.isfinite(value) else value

    def interval(self, stat):
        """``[low, high]`` (floats) or None (too few rounds, or no value at all)."""
        if not self.has_intervals:
            return None
        values = np.concatenate([np.asarray(stat(self.idx[k:k + _CHUNK]), dtype=float)
                                 for k in range(0, self.resamples, _CHUNK)])
        values = values[~np.isnan(values)]
        if values.size == 0:
            return None
        tail = 100 * (1 - self.level) / 2
        unbounded = np.isposinf(values)
        if unbounded.any():
            # Percentiles between a finite value and +inf are not defined: rank-interpolate
            # over a stand-in larger than every finite value, and read it back as unbounded.
            big = np.finfo(float).max / 4
            low, high = np.percentile(np.where(unbounded, big, values), [tail, 100 - tail])
            return [None if low >= big else float(low), None if high >= big else float(high)]
        low, high = np.percentile(values, [tail, 100 - tail])
        return [float(low), float(high)]

    def figure(self, stat) -> dict:
        """``{"value", "interval"}`` of one statistic."""
        return {"value": self.estimate(stat), "interval": self.interval(stat)}


def placement_blocks(rounds: int, placements: int) -> list:
    """The rounds of each placement: ``placements`` blocks of consecutive round indices,
    sizes differing by at most one (the first ones larger)."""
    return [list(map(int, b)) for b in np.array_split(np.arange(rounds), placements)]


def verdict(interval, threshold: float, better: str) -> str:
    """``met`` / ``MISSED`` / ``inconclusive`` for a target ``value <= threshold``
    (``better="below"``) or ``value >= threshold`` (``better="above"``): met or MISSED only
    when ``interval`` excludes the threshold (strictly); None (no interval) is inconclusive.
    An end that is None is +inf (``Bootstrap.interval`` of an unbounded ratio)."""
    if better not in ("below", "above"):
        raise ValueError(f"better={better!r}: expected 'below' or 'above'")
    if interval is None:
        return "inconclusive"
    low, high = (np.inf if end is None else end for end in interval)
    if better == "below":
        return "met" if high < threshold else "MISSED" if low > threshold else "inconclusive"
    return "met" if low > threshold else "MISSED" if high < threshold else "inconclusive"


# -- statistics over per-round arrays ------------------------------------------------------
# ``X`` below is a 2-D float array (rounds, samples per round): every round of a mode has
# the same number of steps (runner.schedule), so a selection of rounds is a fancy index.

def pooled_median(X):
    """The median of every sample of the selected rounds, pooled."""
    X = np.asarray(X, dtype=float)
    return lambda idx: np.median(X[idx].reshape(len(idx), -1), axis=1)


def pooled_mean(X):
    """The mean of every sample of the selected rounds (rounds are equally long)."""
    means = np.asarray(X, dtype=float).mean(axis=1)
    return lambda idx: means[idx].mean(axis=1)


def cost_ratio(num, den):
    """``num / den`` of two statistics (costs: fd-manager's over a mode's), evaluated on the
    same resamples; +inf where ``den`` is zero or negative and ``num`` positive (the mode's
    cost was not resolved above zero: the ratio has no upper bound), NaN where neither is
    positive (nothing to compare)."""
    def stat(idx):
        n, d = np.asarray(num(idx), dtype=float), np.asarray(den(idx), dtype=float)
        out = np.full(n.shape, np.nan)
        positive = d > 0
        out[positive] = n[positive] / d[positive]
        out[~positive & (n > 0)] = np.inf
        return out
    return stat


def ragged_median(rounds):
    """The pooled median for rounds with different sample counts (delivery latencies: a
    round's batches), NaN where the selected rounds hold no sample."""
    rounds = [np.asarray(r, dtype=float) for r in rounds]

    def stat(idx):
        out = np.empty(len(idx))
        for k, row in enumerate(idx):
            pooled = np.concatenate([rounds[i] for i in row])
            out[k] = np.median(pooled) if pooled.size else np.nan
        return out
    return stat
