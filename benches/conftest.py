"""Microbenchmarks only mean something on a release build: refuse anything else.

Also collects the ``bench_*.py`` files (pytest's default patterns only know ``test_*.py``).
"""

from __future__ import annotations

import pytest

import tandem


def pytest_sessionstart(session: pytest.Session) -> None:
    if tandem.build_profile != "release":
        pytest.exit(
            f"refusing to benchmark a {tandem.build_profile} build of tandem._core: the "
            "figures would be meaningless. Build it with `maturin develop --release` (or "
            "`pip install .`), then run the benchmarks again.",
            returncode=2,
        )


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
