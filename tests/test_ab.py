"""benches/ab.py, the side-by-side comparison of two builds, runs as docs/performance.md shows."""

import json
import subprocess
import sys
from pathlib import Path

AB = Path(__file__).resolve().parents[1] / "benches" / "ab.py"


def test_ab_compares_two_builds_in_one_run(tmp_path):
    # Baseline and candidate are both this build: the comparison machinery is what is
    # under test (interleaving, exact CPU per run, medians, the table).
    out = tmp_path / "ab.json"
    args = ["--baseline", sys.executable, "--candidate", sys.executable, "--rate", "400"]
    args += ["--duration", "1.5", "--warmup", "0.5", "--repeat", "1", "--workloads", "demo"]
    args += ["--replication", "1", "--json", str(out)]
    done = subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| demo | 1 | candidate |" in done.stdout
    result = json.loads(out.read_text())
    assert [r["build"] for r in result["runs"]] == ["baseline", "candidate"]
    for run in result["runs"]:
        assert run["events"] == 600 and run["digests_match"]
        assert run["cpu_s"] > 0 and run["p50_ms"] > 0
    assert {s["build"] for s in result["summary"]} == {"baseline", "candidate"}
