"""scripts/benchmarks/gpu_server.py --dry-run: the GPU-server suite, end to end, at small
sizes with the cpu-standin backend: every step runs, and the report holds what README and
docs/performance.md quote (no figure is judged: timings are not assertions here)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "benchmarks", "gpu_server.py")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_writes_the_whole_report(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and report["gpu_backend"] == "cpu-standin"
    names = [s["name"] for s in report["steps"]]
    assert names == ["profile_tp2", "profile_tp8", "bench_sync", "put_floor", "bench_idle"]
    for step in report["steps"]:
        assert not step["timed_out"] and step["returncode"] == 0, (step["name"],
                                                                    step["output"][-2000:])
        assert step["output"].strip(), step["name"]
    for tp in ("2", "8"):
        profile = report["profiles"][tp]
        assert profile["parameters"]["tp"] == int(tp)
        assert set(profile["headline"]) == {"python", "gpu"}
        assert profile["correct"] is True  # every rank took every batch, in order, once
    targets = {(t["target"], str(t["tp"])) for t in report["targets"]}
    assert ("TP=8 critical path p50 <= 2x TP=2's", "8/2") in targets
    assert len(targets) == 7
    md = (out / "report.md").read_text()
    assert "**Dry run**" in md and "not a GPU" in md
    for heading in ("## Machine", "## GPU-server targets", "## Whole cost per step, TP=2",
                    "## Whole cost per step, TP=8", "## bench_sync: printed output",
                    "## put_floor: printed output", "## bench_idle: printed output"):
        assert heading in md, heading
