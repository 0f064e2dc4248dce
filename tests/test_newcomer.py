"""A newcomer's first steps, as the README tells them, on the wheel installed into a fresh
virtual environment and run from a folder outside the checkout: `tandem demo`, the
README's job in ten lines pasted into a file, `tandem services start kafka` and the
README's Kafka example, `tandem demo --ordering kazoo` on the services `tandem services`
started, then `tandem services stop`. Nothing here imports the checkout: every command
runs in the new environment, with this checkout's folders off PATH.

The wheel is built with maturin (`maturin build --release`, a few seconds once `make install`
has compiled the release build), or taken from ``$TANDEM_WHEEL``; the environment gets
tandem's dependencies from the package index (pip's cache makes that quick). The servers
listen on free ports with their data in the test's folder, so servers already running on
the default ports are neither used nor disturbed; the jars come from the user's cache
(``~/.cache/tandem/jars``), downloaded there the first time. Select it with
``-m newcomer``; it is never skipped: a missing Java or maturin fails it with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tandem import testing

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = [
    pytest.mark.newcomer,
    pytest.mark.zookeeper,
    pytest.mark.kafka,
    pytest.mark.timeout(900),
]


def _readme_block(heading: str, language: str = "python") -> str:
    """The first ``language`` block of the README section titled ``heading``."""
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert section, f"README.md has no section '## {heading}'"
    block = re.search(rf"^```{language}\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, f"README.md's '## {heading}' shows no {language} block"
    return block.group(1)


def _wheel(out: Path) -> Path:
    given = os.environ.get("TANDEM_WHEEL")
    if given:
        assert Path(given).is_file(), f"TANDEM_WHEEL={given} is not a file"
        return Path(given)
    maturin = shutil.which("maturin", path=str(Path(sys.executable).parent)) or shutil.which(
        "maturin"
    )
    if maturin:
        command = [maturin, "build", "--release", "--out", str(out)]
    else:  # the README's way: a build environment with maturin from the package index
        command = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(out)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    wheels = sorted(out.glob("tandem_stream-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


class Newcomer:
    """Runs commands in the new environment, from a folder outside the checkout."""

    def __init__(self, venv: Path, home: Path, env: dict[str, str]) -> None:
        self.bin = venv / "bin"
        self.home = home
        self.env = env

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(self.bin / argv[0]) if (self.bin / argv[0]).exists() else argv[0], *argv[1:]],
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        print(f"$ {' '.join(argv)}  -> rc {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def ok(self, *argv: str, timeout: float = 300) -> str:
        done = self.run(*argv, timeout=timeout)
        assert done.returncode == 0, f"{argv}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout


def test_a_newcomer_installs_the_wheel_and_follows_the_readme(tmp_path):
    wheel = _wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    for packaged in ("tandem/_services/control.py", "tandem/_services/jars.json", "tandem/cli.py"):
        assert packaged in names, f"{wheel.name} lacks {packaged}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[kazoo]"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert pip.returncode == 0, pip.stderr

    home = tmp_path / "elsewhere"
    home.mkdir()
    checkout = str(ROOT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TANDEM_SERVICES_SCRIPT"}
    }
    env["PATH"] = os.pathsep.join(
        [str(venv / "bin")]
        + [p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(checkout)]
    )
    zk_port, kafka_port, controller_port = (testing.free_port() for _ in range(3))
    env.update(
        TANDEM_ZK_PORT=str(zk_port),
        TANDEM_KAFKA_PORT=str(kafka_port),
        TANDEM_KAFKA_CONTROLLER_PORT=str(controller_port),
        TANDEM_SERVICES_DIR=str(tmp_path / "services"),
    )
    user = Newcomer(venv, home, env)
    where = user.ok("python", "-c", "import tandem; print(tandem.__file__)")
    assert where.startswith(str(venv)), f"tandem imported from {where}, not the new venv"

    # 1. The demo: a replica SIGKILLed, nothing lost (short: 3 s of source time).
    out = user.ok("tandem", "demo", "--duration", "3", "--rate", "2000")
    assert re.search(r"^\s+lost\s+0$", out, re.M), out
    assert re.search(r"^\s+duplicates\s+0$", out, re.M), out
    assert "fault masked." in out

    # 2. The job in ten lines, pasted into a file.
    (home / "job.py").write_text(_readme_block("A job in ten lines"))
    out = user.ok("python", "job.py")
    first, second = out.splitlines()[:2]
    assert re.fullmatch(
        r"in 3000, out 3000, lost 0, duplicates 0, p99 [\d.]+ ms, "
        r"replicas lost with the killed worker \d+",
        first,
    ), out
    assert second.startswith("[{'key': "), out

    try:
        # 3. Kafka, started as the README says, and the README's Kafka example on it.
        command = _readme_block("Kafka in and out", "bash").split("#")[0].split()
        assert command == ["tandem", "services", "start", "kafka"], command
        out = user.ok(*command)
        assert f"kafka ready at 127.0.0.1:{kafka_port}" in out
        assert user.run("tandem", "services", "status", "kafka").stdout.startswith(
            f"kafka up 127.0.0.1:{kafka_port} pid="
        )
        (home / "kafka_example.py").write_text(_readme_block("Kafka in and out"))
        example = user.run("python", "kafka_example.py")
        assert example.returncode == 0, example.stderr
        assert example.stdout == "in 1000, out 1000, lost 0, duplicates 0, replicas agreed True\n"
        assert not re.search(r"^%\d\|", example.stderr, re.M), "librdkafka logged on success"

        # 4. KaZoo on the services `tandem services` runs: the demo uses them as they are.
        assert f"zookeeper ready at 127.0.0.1:{zk_port}" in user.ok(
            "tandem", "services", "start", "zookeeper"
        )
        out = user.ok("tandem", "demo", "--ordering", "kazoo", "--duration", "3", "--rate", "2000")
        assert re.search(r"^\s+lost\s+0$", out, re.M), out
        assert "started for this command" not in out, "the demo started services of its own"
    finally:
        # 5. Stopped as the README says (also when a step above failed).
        stopped = user.run("tandem", "services", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "kafka stopped" in stopped.stdout and "zookeeper stopped" in stopped.stdout
    status = user.run("tandem", "services", "status")
    assert status.returncode == 3, status
    assert status.stdout.splitlines() == [
        f"zookeeper down 127.0.0.1:{zk_port}",
        f"kafka down 127.0.0.1:{kafka_port}",
    ]
