"""Every Python example of the README and of the documentation site's pages runs as
written; the site's pages name every public name of tandem and tandem_spark; the README
stays a front page.

A block the test must not run carries ``<!-- skip: why -->`` on the line before its
fence. Blocks that start Spark carry the ``spark`` mark, those that read or write Kafka
the ``kafka`` mark (and get the broker), KaZoo-ordered ones both ``zookeeper`` and
``kafka`` (and get both)."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
SKIP = re.compile(r"<!--\s*skip\b[^>]*-->\s*$")


def blocks(path: Path) -> list[tuple[int, str, bool]]:
    """The Python blocks of a page: (line of the fence, code, marked to skip)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((line, m.group(1), bool(SKIP.search(before))))
    return found


def _example(path: Path, line: int, code: str, skip: bool):
    marks = [pytest.mark.spark] if "tandem_spark" in code else []
    if 'ordering="kazoo"' in code:
        marks += [pytest.mark.zookeeper, pytest.mark.kafka]
    elif "td.sources.Kafka" in code or "td.sinks.Kafka" in code:
        marks.append(pytest.mark.kafka)
    if skip:
        marks.append(pytest.mark.skip(reason="marked <!-- skip --> in the page"))
    name = path.relative_to(ROOT).as_posix()
    return pytest.param(path, code, id=f"{name}:{line}", marks=marks)


EXAMPLES = [_example(p, *b) for p in PAGES for b in blocks(p)]


def test_the_pages_show_python_examples():
    readme = blocks(README)
    assert readme, "the README should show a Python example"
    assert any("tandem_spark" not in code for _, code, _ in readme), "and one without Spark"
    for page in ("getting-started.md", "guide/operators.md", "guide/sources-sinks.md"):
        assert blocks(DOCS / page), f"docs/{page} should show a Python example"


@pytest.mark.parametrize(("path", "code"), EXAMPLES)
def test_python_example_runs(path, code, request):
    for service in ("zookeeper", "kafka"):  # `tandem services start`, as the page says
        if request.node.get_closest_marker(service):
            request.getfixturevalue(service)
    exec(compile(code, str(path), "exec"), {"__name__": "__main__"})


def test_the_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= 350, f"README.md has {lines} lines; move long sections into docs/"


def test_every_operator_has_an_example():
    page = DOCS / "guide/operators.md"
    text = page.read_text()
    code = "\n".join(c for _, c, _ in blocks(page))
    for op in ("map", "filter", "flat_map", "key_by", "process", "window", "union", "join"):
        assert re.search(rf"^## .*\b{op}\b", text, flags=re.M), f"no section for {op}"
        assert re.search(rf"\.{op}\(", code), f"no example calls .{op}("


def _site_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")))


@pytest.mark.parametrize("module", ["tandem", "tandem_spark"])
def test_the_site_names_every_public_name(module):
    mod = importlib.import_module(module)  # both are installed by `make install`
    text = _site_text()
    missing = [n for n in mod.__all__ if not re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", text)]
    assert not missing, f"docs/ never mentions {module}.{missing}"


def test_the_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert [p for p in pages if p not in nav] == []
