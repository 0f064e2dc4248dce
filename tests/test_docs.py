"""Every Python example in the README runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _example(i: int, code: str):
    """One README example as a test case: those that start Spark carry the `spark` mark,
    those that read or write Kafka the `kafka` mark (and get the broker)."""
    marks = [pytest.mark.spark] if "tandem_spark" in code else []
    if "td.sources.Kafka" in code or "td.sinks.Kafka" in code:
        marks.append(pytest.mark.kafka)
    return pytest.param(code, id=f"example{i}", marks=marks)


def test_the_readme_shows_python_examples():
    assert BLOCKS, "the README should show a Python example"
    assert any("tandem_spark" not in b for b in BLOCKS), "and one without Spark"


@pytest.mark.parametrize("code", [_example(i, b) for i, b in enumerate(BLOCKS)])
def test_readme_python_example_runs(code, request):
    if request.node.get_closest_marker("kafka"):
        request.getfixturevalue("kafka")  # `scripts/services.sh start kafka`, as the README says
    exec(compile(code, str(README), "exec"), {})
