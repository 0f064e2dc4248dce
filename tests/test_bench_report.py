"""benches/report.py: the Rust/Python ratios and the check `make bench-check` (and so CI)
runs on them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "benches" / "report.py"
spec = importlib.util.spec_from_file_location("bench_report", REPORT)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def _bench(name: str, group: str, mean: float, best: float, rows: int = 1000) -> dict:
    return {
        "name": name,
        "group": group,
        "extra_info": {"rows": rows},
        "stats": {"mean": mean, "min": best},
    }


def _data(*benches) -> dict:
    return {"benchmarks": list(benches), "machine_info": {}}


def test_ratios_per_group_from_mean_or_best_times():
    data = _data(
        _bench("test_a_rust", "a", 0.01, 0.005),
        _bench("test_a_python", "a", 0.5, 0.1),
        _bench("test_b_rust", "b", 0.1, 0.1),
    )
    assert report.ratios(data) == {"a": 50.0, "b": None}
    assert report.ratios(data, stat="min") == {"a": 20.0, "b": None}
    assert "| a | 50x |" in report.report(data)


def test_the_check_fails_below_the_ratio_or_without_a_pair(tmp_path, capsys):
    fast = [_bench("test_a_rust", "a", 0.01, 0.01), _bench("test_a_python", "a", 1.0, 1.0)]
    slow = [_bench("test_b_rust", "b", 0.1, 0.1), _bench("test_b_python", "b", 0.2, 0.2)]
    lines = report.check(_data(*fast, *slow), 10)
    assert lines[0].startswith("ok a: Rust is 100.0x") and lines[1].startswith("FAIL b")
    # Known short: reported, not failing — until it reaches the ratio.
    assert report.check(_data(*fast, *slow), 10, {"b"})[1].startswith("known short b")
    assert report.check(_data(*fast, *slow), 10, {"a"})[0].startswith("FAIL a")
    assert report.check(_data(*fast), 10, {"gone"})[0].startswith("FAIL gone")
    assert report.check(_data(fast[0]), 10)[0].startswith("FAIL a: needs both")
    assert report.check(_data(), 10) == ["FAIL no Rust/Python benchmark pairs in the JSON"]

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_data(*fast, *slow)))
    assert report.main(["report.py", str(path)]) == 0
    assert report.main(["report.py", str(path), "--min-ratio", "10"]) == 1
    assert report.main(["report.py", str(path), "--min-ratio", "10", "--known-short", "b"]) == 0
    assert "known short b" in capsys.readouterr().out


def test_a_group_may_have_a_minimum_of_its_own(tmp_path, capsys):
    fast = [_bench("test_a_rust", "a", 0.01, 0.01), _bench("test_a_python", "a", 1.0, 1.0)]
    slow = [_bench("test_b_rust", "b", 0.1, 0.1), _bench("test_b_python", "b", 0.7, 0.7)]
    lines = report.check(_data(*fast, *slow), 10, group_ratios={"b": 6})
    assert lines[0].startswith("ok a") and lines[1] == (
        "ok b: Rust is 7.0x the Python reference (best of rounds), at least 6x"
    )
    assert report.check(_data(*fast, *slow), 10, group_ratios={"b": 8})[1].startswith("FAIL b")
    assert report.check(_data(*fast), 10, group_ratios={"gone": 6})[0].startswith("FAIL gone")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_data(*fast, *slow)))
    argv = ["report.py", str(path), "--min-ratio", "10"]
    assert report.main([*argv, "--min-ratio-for", "b=6"]) == 0
    assert report.main([*argv, "--min-ratio-for", "b=8"]) == 1
    capsys.readouterr()
