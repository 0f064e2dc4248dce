"""The shape of the code: no import cycles (Python modules, and the Rust crates' modules),
every module importable on its own, engines found through entry points, the library
importing nothing from its experiments, tandem never naming the Spark integration, which
uses tandem's public names only, and service
supervision out of the public surface."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

import tandem
from tandem import engines

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tandem": ROOT / "python" / "tandem",
    "tandem_spark": ROOT / "spark_integration" / "tandem_spark",
}
NATIVE = {"tandem._core"}


def modules() -> dict[str, Path | None]:
    """Every module of both packages, by dotted name (the native one without a file)."""
    found: dict[str, Path | None] = dict.fromkeys(NATIVE)
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known) -> str | None:
    """The module of ours ``name`` is or lives in (``tandem.plan.Plan`` → ``tandem.plan``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, known) -> set[str]:
    """The modules of ours that ``path`` imports anywhere: at the top, inside functions,
    under ``TYPE_CHECKING``. ``from tandem import logs`` imports ``tandem.logs``; the
    implicit import of a module's parent packages is not counted."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name, known) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else _resolve(node.module, known))
    found.discard(None)
    return found


LOADED_BY = {
    engines.ENGINE_GROUP: "tandem.engines",
    engines.BENCHMARK_GROUP: "tandem.experiments",
}
"""Which module loads the entry points of each group (``engines.get``; ``tandem bench``,
through ``tandem.experiments.add_commands``)."""
EXPERIMENTS = "tandem.experiments"
OFFERS_EXPERIMENTS = {"tandem.cli"}
"""The modules of tandem outside the experiments that may import them: the command line,
which offers them as ``tandem bench`` and ``tandem demo``."""


def import_graph() -> dict[str, set[str]]:
    """Module → the modules it imports, and the module that loads an installed entry
    point → the module the entry point names."""
    known = modules()
    graph = {
        name: (imports(path, known) - {name} if path else set()) for name, path in known.items()
    }
    for group, loader in LOADED_BY.items():
        for ep in engines.entry_points(group).values():
            target = _resolve(ep.module, known)
            if target is not None:
                graph[loader].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _experiment(name: str) -> bool:
    return name == EXPERIMENTS or name.startswith(EXPERIMENTS + ".")


def reaching(graph: dict[str, set[str]], start: str, avoid) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others, by the shortest chain
    of imports from ``start`` (the module last); the modules in ``avoid`` are not walked
    through."""
    chains = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w not in chains and w not in avoid:
                chains[w] = [*chains[v], w]
                queue.append(w)
    del chains[start]
    return chains


def library_imports_of_experiments(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module of the library (tandem but its experiments and the command line) that
    imports an experiment module, directly or through other modules (the Spark package's
    included), with one chain of imports that gets there."""
    library = [
        m
        for m in sorted(graph)
        if m.split(".")[0] == "tandem" and not _experiment(m) and m not in OFFERS_EXPERIMENTS
    ]
    found = {}
    for m in library:
        chains = reaching(graph, m, avoid=OFFERS_EXPERIMENTS)
        hits = [chain for name, chain in chains.items() if _experiment(name)]
        if hits:
            found[m] = min(hits, key=len)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "tandem.engines.local" in graph["tandem.engines"], "the local entry point"
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"import cycles (module -> the members it imports): {detail}"


def test_the_experiment_import_finder_follows_chains_of_imports():
    graph = {
        "tandem.api": {"tandem.plan"},
        "tandem.plan": {"tandem.experiments.workloads"},
        "tandem.cli": {"tandem.experiments"},
        "tandem.logs": {"tandem.cli"},
        "tandem.experiments": set(),
        "tandem.experiments.workloads": {"tandem.api"},
    }
    assert library_imports_of_experiments(graph) == {
        "tandem.api": ["tandem.api", "tandem.plan", "tandem.experiments.workloads"],
        "tandem.plan": ["tandem.plan", "tandem.experiments.workloads"],
    }


def test_the_library_imports_nothing_from_the_experiments():
    """``tandem.experiments`` sits beside the library: no module of tandem but the
    experiments and the command line imports one of them, directly or through other
    modules (those of the Spark package, which tandem loads as the ``spark`` engine,
    included)."""
    graph = import_graph()
    assert "tandem.experiments.workloads" in graph, "the experiments are where they are meant"
    assert "tandem.experiments" in graph["tandem.cli"], "the command line offers them"
    found = library_imports_of_experiments(graph)
    detail = {m: " -> ".join(chain) for m, chain in found.items()}
    assert not found, f"the library imports the experiments: {detail}"


RUST = ROOT / "rust"


def _rust_code(path: Path) -> str:
    """The code of a Rust file without its comments (docs included) and without the items
    under ``#[cfg(test)]`` or ``#[cfg(doc)]``: a test module, or an import for a doc link,
    is no dependency."""
    code = "\n".join(line.split("//", 1)[0] for line in path.read_text().splitlines())
    attr = re.compile(r"#\[cfg\((?:test|doc)\)\]")
    while m := attr.search(code):
        semi, brace = code.find(";", m.end()), code.find("{", m.end())
        if brace < 0 or 0 <= semi < brace:
            end = semi + 1
        else:
            depth, end = 0, brace
            while True:
                depth += {"{": 1, "}": -1}.get(code[end], 0)
                end += 1
                if depth == 0:
                    break
        code = code[: m.start()] + code[end:]
    return code


def rust_graph(src: Path) -> dict[str, set[str]]:
    """A crate's top-level module → the modules of the crate it names (``crate::x``,
    ``use crate::{x, y::z}``, or a name the crate root re-exports from a module); test-only
    modules are left out."""
    lib = _rust_code(src / "lib.rs")
    test_only = set(re.findall(r"#\[cfg\(test\)\]\s*mod (\w+);", (src / "lib.rs").read_text()))
    mods = {p.stem for p in src.glob("*.rs")} | {p.parent.name for p in src.glob("*/mod.rs")}
    mods -= {"lib"} | test_only
    reexported = {
        name.strip(): module
        for module, names in re.findall(r"pub use (\w+)::\{([^}]*)\}", lib)
        for name in names.split(",")
    }
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for path in sorted(src.rglob("*.rs")):
        top = path.relative_to(src).parts[0].removesuffix(".rs")
        if top not in mods:
            continue
        for group in re.findall(r"\bcrate::(\{[^}]*\}|\w+)", _rust_code(path)):
            names = re.findall(r"[{,]\s*(\w+)", group) if group[0] == "{" else [group]
            for name in names:
                target = name if name in mods else reexported.get(name)
                if target and target != top:
                    graph[top].add(target)
    return graph


def test_the_rust_graph_sees_uses_and_leaves_tests_and_doc_links_out(tmp_path):
    (tmp_path / "lib.rs").write_text(
        "pub mod a;\npub mod b;\n#[cfg(test)]\nmod t;\npub use b::{Thing, Other};\n"
    )
    (tmp_path / "a.rs").write_text(
        "//! See [`crate::t`].\nuse crate::{Thing, b::x};\n#[cfg(doc)]\nuse crate::t::Y;\n"
        "#[cfg(test)]\nmod tests {\n    use crate::t::*;\n    fn f() { let _ = {1}; }\n}\n"
    )
    (tmp_path / "b.rs").write_text("fn g() -> crate::a::A { todo!() }\n")
    (tmp_path / "t.rs").write_text("use crate::a::A;\n")
    assert rust_graph(tmp_path) == {"a": {"b"}, "b": {"a"}}


def test_no_module_cycles_in_the_rust_core():
    graph = rust_graph(RUST / "tandem-core" / "src")
    assert {"inbox", "link", "divergence", "orderfeed"} <= graph.keys()
    assert graph["divergence"].isdisjoint({"inbox", "link", "orderfeed"})
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"module cycles in tandem-core (module -> the members it names): {detail}"


def test_the_bindings_cycle_only_through_the_worker():
    """A ``Worker`` is built from inboxes and outboxes, which take their worker as an
    argument (``Inbox(worker=)``, ``OrderPublisher(worker)``): that is the one cycle of
    tandem-py's files; without ``worker`` there is none."""
    graph = rust_graph(RUST / "tandem-py" / "src")
    assert {"inbox", "outbox", "orderfeed", "worker"} <= graph.keys()
    rest = {m: deps - {"worker"} for m, deps in graph.items() if m != "worker"}
    assert cycles(rest) == [], rest


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """An import-order dependency (a module that works only when another was imported
    first) fails here even where no cycle shows."""
    names = sorted(m for m in modules() if m not in NATIVE)

    def run(name: str) -> tuple[str, subprocess.CompletedProcess]:
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return name, done

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = {
            name: done.stderr.strip().splitlines()[-1]
            for name, done in pool.map(run, names)
            if done.returncode != 0
        }
    assert not failed, failed


def test_the_spare_and_the_priorities_import_only_the_standard_library_at_their_top():
    """A spare runs ``tandem/engines/spare.py`` by its file and loads
    ``tandem/runtime/priority.py`` from its file before it lowers its priority: neither
    may import anything but the standard library before it does (inside a function, once
    the priority dropped, is for the spare to say)."""
    found = {}
    for path in (
        PACKAGES["tandem"] / "engines" / "spare.py",
        PACKAGES["tandem"] / "runtime" / "priority.py",
    ):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]
            if bad:
                found[f"{path.name}:{node.lineno}"] = bad
    assert not found, found


def test_tandem_never_names_the_spark_package():
    """tandem finds the Spark engine through its entry point; not one line of tandem,
    code or docstring, names ``tandem_spark``."""
    naming = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(PACKAGES["tandem"].rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "tandem_spark" in line
    ]
    assert not naming, naming


def test_the_spark_package_uses_public_names_of_tandem_only():
    private = []
    for path in sorted(PACKAGES["tandem_spark"].rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tandem."):
                names = [a.name for a in node.names if a.name.startswith("_")]
                if any(p.startswith("_") for p in node.module.split(".")) or names:
                    private.append(f"{path.name}:{node.lineno} from {node.module} import {names}")
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                mods.append(getattr(node, "module", None) or "")
                if any(m == "tandem.engines.local" for m in mods):
                    private.append(f"{path.name}:{node.lineno} imports the local engine")
    assert not private, private


def _declared(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=group)}


def test_engines_are_installed_entry_points():
    """The installed metadata declares both engines (pyproject.toml, spark_integration's
    pyproject.toml: reinstall after changing them), and ``get`` loads them by name."""
    import tandem_spark

    assert _declared(engines.ENGINE_GROUP) == {
        "local": "tandem.engines.local:LocalEngine",
        "spark": "tandem_spark:SparkEngine",
    }
    assert _declared(engines.BENCHMARK_GROUP) == {"spark": "tandem_spark.bench"}
    assert engines.available() == ["local", "spark"]
    from tandem.engines.local import LocalEngine

    assert isinstance(engines.get("local"), LocalEngine)
    spark = engines.get("spark", master="local[2,2]")
    assert isinstance(spark, tandem_spark.SparkEngine) and spark.master == "local[2,2]"
    assert engines.load(engines.BENCHMARK_GROUP, "spark", "benchmark") is tandem_spark.bench


def test_tandem_declares_its_builtin_entry_points_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][engines.ENGINE_GROUP]
    assert declared == engines._BUILTIN[engines.ENGINE_GROUP]


def test_an_engine_not_installed_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setattr(engines.metadata, "entry_points", lambda group: [])
    assert engines.available() == ["local"]
    with pytest.raises(tandem.ConfigError, match=r"unknown engine 'spark'.*\['local'\]"):
        engines.get("spark")
    with pytest.raises(tandem.ConfigError, match=r"pip install \./spark_integration"):
        engines.load(engines.BENCHMARK_GROUP, "spark", "benchmark")
    with pytest.raises(tandem.ConfigError, match=r"unknown engine 'nope'; installed: \['local'\]$"):
        engines.get("nope")


def test_result_lives_apart_from_the_api_and_keeps_its_public_names():
    from tandem.result import Result

    assert tandem.Result is Result
    assert "Result" not in tandem.api.__all__


def test_service_supervision_is_not_public():
    assert "services" not in tandem.__all__ and not hasattr(tandem, "services")
    assert not (PACKAGES["tandem"] / "services.py").exists()
    done = subprocess.run(
        [sys.executable, "-c", "import sys, tandem; print('tandem._services' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "False", "importing tandem must not load the supervision"
