"""``fastdeploy-sync profile`` end to end (real engine and worker processes, every mode, both
step kinds) and its report on synthetic runs.

End to end asserts what is not a timing: every batch delivered, ranks agree, the JSON holds
every figure with its definition, the PNG is written, one definition of delivery in the
terminal, the JSON and the plot, a verdict count that matches the rows. The synthetic runs
test the verdict logic itself: an interval across the target is inconclusive, one far on
either side met or MISSED, and runs drawn from the same machine never flip met <-> MISSED."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from fastdeploy_sync.envs import ipc_dir
from fastdeploy_sync.testing.processes import children

PROFILE = [sys.executable, "-m", "fastdeploy_sync.cli", "profile", "--no-progress"]


STATS = {"p50_us", "p99_us", "mean_us", "max_us", "count"}


HAS_PADDLE = importlib.util.find_spec("paddle") is not None


MODES = ("async", "sync", "fd-manager")


def _run(args, timeout=300):
    return subprocess.run(PROFILE + args, capture_output=True, text=True, timeout=timeout)


def _left_by(run_name):
    """What run ``run_name`` left in /dev/shm and the ipc directory: names of that run
    only (other profile runs, this suite's or another program's, may be live beside it)."""
    return (glob.glob(f"/dev/shm/*{run_name}*")
            + glob.glob(os.path.join(ipc_dir(), f"fdsync-{run_name}*")))


def _figure(f, interval=True):
    assert set(f) == {"value", "interval"}, f
    assert isinstance(f["value"], float)
    if interval:
        low, high = f["interval"]
        assert low <= high


# Bounds on a hang, not on speed: the run took over 180 s (pytest's default timeout) beside
# two CPU-bound processes.
@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_profile_all_modes_both_step_kinds(tmp_path, foreign_names):
    json_path, png_path = tmp_path / "profile.json", tmp_path / "profile.png"
    steps, rounds, idle = 100, 5, 150
    kinds = ["python", "paddle"] if HAS_PADDLE else ["python"]
    out = _run(["--steps", str(steps), "--rounds", str(rounds), "--idle-steps", str(idle),
                "--step", ",".join(kinds), "--json", str(json_path), "--plot", str(png_path)],
               timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(json_path.read_text())
    from fastdeploy_sync.profiling import plot, vocabulary

    assert summary["schema"] == vocabulary.SCHEMA
    p = summary["parameters"]
    assert p["modes"] == list(MODES) and p["step_kinds"] == kinds and p["tp"] == 2
    assert set(p["units_per_step"]) == set(kinds)
    assert summary["intervals"]["rounds"] == rounds and summary["intervals"]["level"] == 0.95
    assert summary["definitions"] == vocabulary.DEFINITIONS
    for kind in kinds:
        k = summary["step_kinds"][kind]
        assert set(k["modes"]) == {"none", *MODES}
        for mode in ("none", *MODES):
            m = k["modes"][mode]
            intr = m["interruption"]
            for name in ("off_cpu_us", "run_queue_us", "gil_wait_us", "other_us"):
                _figure(intr[name])
            _figure(intr["involuntary_switches_per_step"])
            assert intr["gil_wait_us"]["value"] >= 0 and intr["run_queue_us"]["value"] >= 0
            assert m["step_ms"]["count"] == steps
            if mode == "none":
                continue
            _figure(intr["gil_wait_added_pct"])
            assert set(m["critical_path_us"]) == STATS
            assert m["critical_path_us"]["count"] == steps
            assert set(m["critical_path_by_section_us"]) == {"check", "barrier", "take"}
            assert len(m["critical_path_by_rank_us"]) == 2
            assert len(m["critical_path_samples_us"]) == steps
            for name in ("critical_path_p50_us", "inflation_pct", "critical_path_share_pct",
                         "model_slowdown_pct", "delivery_p50_ms"):
                _figure({k: v for k, v in m[name].items() if k != "per_round"})
            assert len(m["inflation_pct"]["per_round"]) == rounds
            # every batch the engine put reached every rank, identically, once, in every
            # round (the fd-manager queue is one queue reused by all its segments)
            assert m["batches"]["put"] > 0, (kind, mode)
            assert m["batches"]["taken_per_rank"] == [m["batches"]["put"]] * 2, (kind, mode)
            assert m["batches"]["all_delivered"] and m["ranks_agree"], (kind, mode, m["problems"])
            assert m["delivery_ms"]["count"] == m["batches"]["put"]
            assert len(m["delivery_samples_ms"]) == m["batches"]["put"]
            assert 0 <= m["delivery_boundaries"]["share_first"] <= 1
            assert m["delivery_boundaries"]["mean"] >= 1
    assert summary["correct"] is True
    idle_modes = summary["idle"]["modes"]
    assert set(idle_modes) == {"none", *MODES}
    assert idle_modes["none"]["iterations"] == idle
    # Every mode's idle windows open after the same unmeasured iterations: the steady loop,
    # not the start-up of the client each segment builds (which filled a 60-iteration
    # window's whole difference from none's loop).
    from fastdeploy_sync.profiling.loops import IDLE_WARMUP_STEPS
    for mode in ("none", *MODES):
        assert idle_modes[mode]["warmup_iterations"] == rounds * IDLE_WARMUP_STEPS, mode
    # The no-GIL-hog property, robustly: the prefetch thread is blocked in poll while idle
    # (30 iterations, ~35 ms, per round: a heartbeat in a window is well under the bound).
    assert max(idle_modes["async"]["prefetch_thread_cpu_pct"]) < 2.0
    assert idle_modes["sync"]["prefetch_thread_cpu_pct"] == [None, None]

    # One verdict per target row, and the header counts exactly those words.
    targets = summary["targets"]
    assert len(targets) == 6 * len(kinds) + 2  # and two idle rows
    for t in targets:
        assert t["verdict"] in ("met", "MISSED", "inconclusive"), t
    counts = summary["verdicts"]
    for word in ("met", "MISSED", "inconclusive"):
        assert counts[word] == sum(t["verdict"] == word for t in targets)
        assert f"{counts[word]} {word}" in counts["header"]
    assert counts["header"] in out.stdout

    # The headline (the whole cost per step) and the regime, in the JSON and the terminal
    assert summary["reference_config"] == "TP=2" and summary["targets_for"] == "TP=2"
    for kind in kinds:
        for mode in MODES:
            h = summary["headline"][kind][mode]
            _figure(h["inflation_pct"])
            _figure(h["interruption_us"])
            if mode != "fd-manager":
                assert h["interruption_vs_fd_manager"] is not None, (kind, mode)
    regime = summary["regime"]
    assert regime["cores"] == len(os.sched_getaffinity(0)) and regime["pinned"] is False
    assert regime["processes"] == {"engine": 1, "ranks": 2, "fd_manager_server": 1}
    # async ranks run the event loop and the prefetch thread at least
    assert all(n >= 2 for n in regime["threads"]["async"]["ranks_python"])
    assert {s["on"] for s in regime["model_step"].values()} == {"CPU"}
    lines = out.stdout.splitlines()
    assert lines[2] == regime["line"] and lines[2].startswith("regime: ")
    assert out.stdout.index("whole cost per step") < out.stdout.index("critical path per step")

    # One definition of delivery in the terminal, the JSON and the plot.
    assert vocabulary.DELIVERY in out.stdout
    assert summary["definitions"]["delivery"].startswith(vocabulary.DELIVERY)
    assert any(vocabulary.DELIVERY in title for title in plot.panel_titles(summary))
    for heading in ("critical path per step", "interruption of the model step",
                    "effect on the loop", "targets (95% interval", "definitions:"):
        assert heading in out.stdout
    for name, text in vocabulary.DEFINITIONS.items():
        assert f"  {name}: {text}" in out.stdout

    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # every segment's shared memory and socket files are gone
    assert re.fullmatch(r"prof[0-9a-f]{10}", summary["run_name"]), summary["run_name"]
    assert not _left_by(summary["run_name"])


def test_profile_token_lists_tp1(tmp_path):
    """TP=1 (no barrier at all) with token ids as Python lists, one mode, one step kind."""
    json_path = tmp_path / "p.json"
    out = _run(["--mode", "sync", "--tp", "1", "--step", "python", "--tokens", "list",
                "--steps", "100", "--rounds", "1", "--idle-steps", "0", "--batch", "8",
                "--json", str(json_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(json_path.read_text())
    m = summary["step_kinds"]["python"]["modes"]["sync"]
    assert m["ranks_agree"] and m["batches"]["all_delivered"] and m["batches"]["put"] > 0
    assert summary["idle"] is None and summary["targets"] == []
    assert m["critical_path_p50_us"]["interval"] is None  # one round: no interval


def test_profile_cpus_pins_the_engine_and_each_rank(tmp_path):
    """--cpus: every process reports the cores the kernel lets it run on after pinning."""
    cores = sorted(os.sched_getaffinity(0))
    engine_cpu, rank_cpu = cores[0], cores[-1]
    json_path = tmp_path / "p.json"
    out = _run(["--mode", "sync", "--tp", "1", "--step", "python", "--steps", "40",
                "--rounds", "1", "--idle-steps", "0", "--batch", "4", "--cpus",
                f"{engine_cpu},{rank_cpu}", "--json", str(json_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    p = json.loads(json_path.read_text())["parameters"]
    assert p["cpus"] == [engine_cpu, rank_cpu]
    assert p["engine_cpus"] == [engine_cpu]
    assert [c["cpus"] for c in p["calibration"]["python"]] == [[rank_cpu]]
    assert "pinned: engine cpu" in out.stdout


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs /proc/<pid>/task/<tid>/children")
@pytest.mark.serial
def test_a_worker_stuck_at_exit_leaves_no_shared_memory(monkeypatch, foreign_names):
    """The fd-manager's server stops answering (SIGSTOP) before the run ends: the workers'
    manager clients then hang while closing, and the runner kills them after its exit
    bound. Their model collective's shared memory must be gone all the same (a worker
    closed it last, after the manager client, and a killed run left it in /dev/shm), and
    so must the killed engine's flags segment."""
    import signal
    import uuid

    from fastdeploy_sync.profiling import runner

    # Long enough for a rank of a loaded machine to get the exit command and close its
    # collective; the manager clients then hang until the bound.
    monkeypatch.setattr(runner, "_EXIT_TIMEOUT_S", 10.0)
    options = runner.ProfileOptions(mode="fd-manager", step_kinds=["python"], steps=20,
                                    rounds=1, idle_steps=0).validate()
    run_name = f"prof{uuid.uuid4().hex[:10]}"
    procs = runner._Processes(options, run_name)
    # The engine's fd-manager server address (its port names the flags segment): as the
    # runner reads it, from the engine's "opened" answer.
    opened = []
    expect = procs.expect

    def expect_and_keep(who, kind, *args, **kwargs):
        got = expect(who, kind, *args, **kwargs)
        if kind == "opened":
            opened.extend(got)
        return got

    monkeypatch.setattr(procs, "expect", expect_and_keep)
    stopped = []
    try:
        procs.expect([procs.engine], "ready", 120)
        calibration = procs.expect(procs.workers, "calibrated", 120)
        procs.send(procs.workers, ("units", {"python": calibration[0]["python"]["units"]}))
        segment = runner._run_segment(procs, options, f"{run_name}s0", "fd-manager", "python",
                                      "load", 0, 20, None)
        assert segment["put"] > 0
        [(_, port)] = opened
        flags = f"/dev/shm/fdsync-fdq-exist-{port}"
        assert os.path.exists(flags)
        stopped = children(procs.procs[procs.engine].pid)  # the manager's server process
        assert stopped, "the engine has no manager process"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        assert glob.glob(f"/dev/shm/*{run_name}m*")  # the collective exists until the exit
    finally:
        procs.close()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not glob.glob(f"/dev/shm/*{run_name}*")
    # nor the killed engine's fd-manager flags segment (named by its server's port, not
    # by the run: it stayed in /dev/shm after every full test run). Only its own: other
    # programs' servers come and go meanwhile (the foreign_names fixture's do), and a
    # live one's flags must stay (the fixture checks that).
    assert not os.path.exists(flags)


@pytest.mark.parametrize("args, message", [
    (["--steps", "3", "--rounds", "5"], "--steps 3: expected >= --rounds (5)"),
    (["--idle-steps", "3", "--rounds", "5"], "--idle-steps 3: expected 0 or >= --rounds (5)"),
    (["--tp", "0"], "--tp 0: expected 1..16"),
    (["--rate", "-1"], "--rate -1.0: expected >= 0"),
    (["--step-ms", "0"], "--step-ms 0.0: expected > 0"),
    (["--step", "python,cuda"], "--step python,cuda: expected one or more of"),
    (["--gpu-backend", "cuda", "--step", "gpu"], "--gpu-backend 'cuda': expected auto"),
    (["--step", "python,python"], "each once"),
    (["--cpus", "0,0"], "--cpus 0,0: expected 3 cores"),
    (["--cpus", "0,0,99999"], "--cpus: core 99999 is not available"),
    (["--cpus", "a,b"], "expected comma-separated core numbers"),
])
def test_bad_options_are_refused_before_anything_starts(args, message):
    out = _run(args, timeout=60)
    assert out.returncode == 2 and message in out.stderr


def test_help_names_the_step_kinds_and_quotes_no_measured_figure():
    out = subprocess.run(PROFILE[:-1] + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "python,paddle" in text and "gpu" in text and "docs/profiling.md" in text
    # measured figures live in docs/profiling.md, not in --help
    assert not re.search(r"\d+(\.\d+)?\s*(s|us|µs|ms|%) (wall|on a|in three)", text)
    assert "measured" not in text.replace("docs/profiling.md gives measured run times", "")


def test_each_placement_runs_its_rounds_in_freshly_started_processes():
    """--placements 2: the first round's segments ran in one set of worker processes, the
    second round's in another (process placement is sampled, not fixed for the run)."""
    from fastdeploy_sync.profiling import runner

    options = runner.ProfileOptions(mode="async", step_kinds=["python"], steps=20, rounds=2,
                                    placements=2, idle_steps=0)
    raw = runner.run_profile(options)
    first, second = raw["placement_pids"]
    assert len(first) == len(second) == 3 and not set(first) & set(second)
    for seg in raw["segments"]:
        pids = {w["pid"] for w in seg["workers"]}
        assert pids <= set((first, second)[seg["round"]][1:]), (seg["round"], pids)
