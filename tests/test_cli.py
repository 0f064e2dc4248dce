"""The command line as a user runs it: `tandem demo`, `tandem run job.py`, bad flags."""

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.cli import build_parser, main, parse_kill

FIELDS = {
    "events_in",
    "events_out",
    "lost",
    "duplicates",
    "p50_ms",
    "p99_ms",
    "max_gap_ms",
    "per_second_p99_ms",
    "digests_match",
}


def test_demo_masks_the_kill_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    code = main(
        [
            "demo",
            "--duration",
            "3",
            "--rate",
            "600",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result.keys() >= FIELDS
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    assert result["events_in"] == result["events_out"] == 1800
    assert [f["task"] for f in result["faults"]] == ["count"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fault masked" in printed


def test_demo_kills_a_sink_replica_and_masks_it(tmp_path, capsys):
    """The demo's sink is replicated: ``--kill sink:0:0@1.5`` takes its worker down, and
    the twin's copy is the output — every row once."""
    out = tmp_path / "sink.json"
    flags = ["--duration", "3", "--rate", "600", "--no-progress", "--plot", "none"]
    code = main(["demo", "--kill", "sink:0:0@1.5", *flags, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    assert result["events_in"] == result["events_out"] == 1800
    assert [(f["task"], f["replica"]) for f in result["faults"]] == [("sink", 0)]
    assert "fault masked" in printed


def test_chaos_demo_rebuilds_what_it_kills_and_marks_it_on_the_plot(tmp_path, capsys):
    out, png = tmp_path / "chaos.json", tmp_path / "chaos.png"
    flags = ["--duration", "10", "--rate", "1000", "--no-progress", "--json", str(out)]
    code = main(["demo", "--chaos", "5", *flags, "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    kills = [f for f in result["faults"] if f["kind"] == "chaos"]
    assert kills, result["faults"]
    assert {r["lost_s"] for r in result["restored_replicas"]} == {f["injected_at"] for f in kills}
    assert "chaos: SIGKILL a random worker" in printed and "replicas rebuilt" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kazoo_demo_kills_the_leader_and_masks_it(zookeeper, kafka, tmp_path, capsys):
    out = tmp_path / "kazoo.json"
    flags = ["--duration", "4", "--rate", "600", "--no-progress", "--json", str(out)]
    code = main(["demo", "--ordering", "kazoo", *flags, "--plot", str(tmp_path / "kazoo.png")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    (fault,) = result["faults"]
    assert (fault["task"], fault["replica"]) == ("count", "leader")
    # The killed leader led first (its term ended with it), a twin from then on.
    first, *after = result["leaders"]["count[0]"]
    assert first["replica"] == fault["victim"] and first["until_s"] is None, first
    assert after and after[0]["replica"] != fault["victim"], after
    assert "leaders of count[0]" in printed and "fault masked" in printed


def test_run_a_job_file(tmp_path):
    job = tmp_path / "myjob.py"
    job.write_text(
        textwrap.dedent(
            """
            import pyarrow as pa
            import pyarrow.compute as pc
            import tandem as td

            def double(batch: pa.RecordBatch) -> pa.RecordBatch:
                return batch.append_column("twice", pc.multiply(batch.column("value"), 2))

            job = td.Job("mine", replication=2)
            src = job.source(td.sources.Synthetic(rate=400, keys=10, seed=5))
            src.map(double, name="double").sink(td.sinks.Collect())
            duration = 2
            faults = [td.Kill("double", partition=0, replica=1, at=1.0)]
            """
        )
    )
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", str(job), "--no-progress", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["events_out"] == 800 and result["lost"] == 0
    # The killed worker hosted replica 1 of every task, "double"[0] among them.
    assert {"task": "double", "partition": 0, "replica": 1, "cause": "killed"} in result[
        "lost_replicas"
    ]


@pytest.mark.parametrize("spec", ["count:0", "count:x:0@1", "count:0:0", "@3"])
def test_bad_kill_spec_is_a_usage_error(spec):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--kill", spec])
    assert exc.value.code == 2


def test_kill_spec_parses_roles_and_indices():
    assert parse_kill("count:1:0@2.5").replica == 0
    assert parse_kill("count:1:leader@30").replica == "leader"


def test_a_job_file_without_a_job_is_explained(tmp_path, capsys):
    bad = tmp_path / "nojob.py"
    bad.write_text("x = 1\n")
    assert main(["run", str(bad), "--no-progress"]) == 2
    assert "must define a module-level `job = td.Job(...)`" in capsys.readouterr().err


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["demo", "run"])
def test_help_describes_every_option_with_its_default(command, capsys):
    parser = _subcommand(command)
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help) > 10, f"tandem {command} {name}: no help text"
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert parser.description and "exit codes: 0 a clean run" in text and "2 a usage error" in text
    if command == "demo":
        for default in ("(default: 5000)", "(default: 20.0)", "(default: liverobin)"):
            assert default in text
        assert "--no-progress no progress bar" in text


def test_a_bad_duration_is_reported_before_the_default_kill_is_built(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--duration", "-1", "--kill", "none"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "tandem demo: error: argument --duration: must be seconds > 0, got -1" in err
    assert "Kill" not in err


def test_a_bad_kill_is_reported_by_its_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--kill", "bogus"])
    assert exc.value.code == 2
    assert "tandem demo: error: argument --kill: " in capsys.readouterr().err


def test_a_failed_job_exits_with_1_and_a_config_error_with_2(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(
            """
            import tandem as td

            def broken(batch):
                if batch.num_rows:
                    raise ValueError("a bug in the job")
                return batch

            job = td.Job("fails", replication=2)
            src = job.source(td.sources.Synthetic(rate=500, keys=10, limit=200))
            src.map(broken, name="broken").sink(td.sinks.Collect())
            """
        )
    )
    assert main(["run", str(script), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "TaskFailed" in err
    # The worker's traceback names the script's file and line, not <dynamic-code>.
    assert f'File "{script}", line 6, in broken' in err, err
    # A fault that could never fire: the source ends 0.4 s in.
    assert main(["run", str(script), "--kill", "broken:0:0@5"]) == 2
    assert "would never fire" in capsys.readouterr().err


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    job = tmp_path / "quiet.py"
    job.write_text(
        textwrap.dedent(
            """
            import tandem as td

            job = td.Job("quiet", replication=2)
            job.source(td.sources.Synthetic(rate=1_000, keys=10, limit=1_000)).sink(
                td.sinks.Collect()
            )
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", str(job)],  # no --no-progress
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\r" not in proc.stderr and "s/s" not in proc.stderr, proc.stderr


def test_a_socket_left_by_a_killed_run_is_not_a_run_even_when_its_pid_is_reused(
    tmp_path, monkeypatch
):
    """A SIGKILLed `tandem run` leaves its control socket; the PID in its name may be a
    live process's by now (here this one's), which listens nowhere: `tandem savepoint`
    must not count it as a run."""
    import socket as sockets

    from tandem import control

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    where = control.folder()
    where.mkdir(parents=True)
    stale = where / f"killed.{os.getpid()}.sock"
    s = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    s.bind(str(stale))  # bound, never listening, then gone: what a killed run leaves
    s.close()
    live = control.ControlServer("alive", lambda path, stop: None)
    try:
        assert [job for job, _, _ in control.running()] == ["alive"]
        assert not stale.exists(), "the stale socket is removed"
    finally:
        live.close()
