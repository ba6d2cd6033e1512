"""The direction of the package's dependencies, read from its source (every import
statement, also those inside functions): the protocol imports nothing from the trainer,
the world or the shipped callbacks; the trainer and the world import no shipped callback and
nothing of fault tolerance (which builds on them, in one package); and the packages import
each other without a cycle."""

import ast
from pathlib import Path

import dream_trainer

ROOT = Path(dream_trainer.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The dream_trainer modules `path` imports (absolute and relative, at any depth)."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
    return {name for name in found if name == "dream_trainer" or name.startswith("dream_trainer.")}


def _unit(module: str) -> str:
    """The part of the house a module belongs to: its subpackage, or the module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dream_trainer"


GRAPH = {_module(p): _imports(p) for p in ROOT.rglob("*.py")}


def _offending(source_unit: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {i}" for m, imps in GRAPH.items() if _unit(m) == source_unit
                  for i in imps if _unit(i) in forbidden)


def test_the_protocol_imports_nothing_from_the_trainer_world_or_shipped_callbacks():
    assert {"dream_trainer.protocol.base", "dream_trainer.protocol.collection"} <= set(GRAPH)  # not vacuous
    assert _offending("protocol", ("trainer", "world", "callbacks", "dream_trainer")) == []


def test_the_trainer_and_the_world_import_no_shipped_callback():
    assert _offending("trainer", ("callbacks", "fault_tolerance")) == []
    assert _offending("world", ("callbacks", "trainer", "fault_tolerance")) == []


def test_fault_tolerance_is_one_package_below_the_shipped_callbacks():
    """Everything of fault tolerance lives in `dream_trainer.fault_tolerance`; it meets the
    checkpoint callback through public seams (`Checkpointer`, the world's `resume_roots`),
    never by importing a shipped callback."""
    ft_modules = {m for m in GRAPH if _unit(m) == "fault_tolerance"}
    assert {"dream_trainer.fault_tolerance.world", "dream_trainer.fault_tolerance.callback"} <= ft_modules
    assert _offending("fault_tolerance", ("callbacks",)) == []
    elsewhere = sorted(m for m in GRAPH if _unit(m) not in ("fault_tolerance", "testing")
                       and any(word in m for word in ("fault", "ft_", ".ft")))
    assert elsewhere == []


def test_the_packages_import_each_other_without_a_cycle():
    edges = {}
    for module, imports in GRAPH.items():
        if _unit(module) in ("dream_trainer", "testing"):
            continue  # the public API re-exports everything; the test kit uses everything
        edges.setdefault(_unit(module), set()).update(_unit(i) for i in imports if _unit(i) != _unit(module))
    cycles = []

    def visit(node, path):
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            visit(start, [start])
    assert cycles == []


COMPONENTS = ("dream_trainer.trainer.control", "dream_trainer.trainer.metric_log", "dream_trainer.trainer.build_record",
              "dream_trainer.trainer.telemetry", "dream_trainer.trainer.step_path",
              "dream_trainer.trainer.data_position", "dream_trainer.trainer.epochs", "dream_trainer.trainer.model_facts",
              "dream_trainer.trainer.goodput")


def test_the_trainer_components_import_no_trainer():
    """Components own their state with no trainer in them: they import the protocol, the
    utilities and other components at most, never a trainer module (the trainer composes
    them)."""
    assert set(COMPONENTS) <= set(GRAPH)
    offending = sorted(f"{m} imports {i}" for m in COMPONENTS for i in GRAPH[m]
                       if (i.startswith("dream_trainer.trainer") and i not in COMPONENTS)
                       or _unit(i) in ("callbacks", "world", "checkpoint"))
    assert offending == []


def test_the_former_name_of_fault_tolerance_is_gone():
    import importlib

    import pytest

    assert "dream_trainer.ft" not in GRAPH
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dream_trainer.ft")


def test_the_trainer_does_not_import_the_launcher():
    """The trainer reads exit codes, stop signals and the run's identity from leaves
    (`dream_trainer.exits`, `dream_trainer.run_identity`) that the launcher reads too."""
    assert "dream_trainer.launch" in GRAPH  # not vacuous
    trainer = [m for m in GRAPH if _unit(m) == "trainer"]
    assert "dream_trainer.trainer.base" in trainer
    assert sorted(f"{m} imports {i}" for m in trainer for i in GRAPH[m] if i == "dream_trainer.launch") == []


def test_exit_codes_and_signals_are_a_leaf_and_the_run_identity_nearly_one():
    assert GRAPH["dream_trainer.exits"] == set()
    assert GRAPH["dream_trainer.run_identity"] == {"dream_trainer.cluster", "dream_trainer.configs"}
    assert {"dream_trainer.exits", "dream_trainer.run_identity"} <= GRAPH["dream_trainer.launch"]


def test_the_cluster_environment_is_a_leaf():
    """Read by the protocol (where rank-zero callbacks run), the world and the launcher: it
    imports nothing of the house."""
    assert "dream_trainer.cluster" in GRAPH
    assert GRAPH["dream_trainer.cluster"] == set()


def test_the_token_data_is_a_leaf():
    """Token files and the global order are plain numpy: usable (and tested) without a trainer."""
    assert GRAPH["dream_trainer.data.tokens"] == {"dream_trainer.data.order", "dream_trainer.durable"}
    assert GRAPH["dream_trainer.durable"] == set()
    assert GRAPH["dream_trainer.data.order"] == set()
    assert GRAPH["dream_trainer.data.prepare"] == {"dream_trainer.data.tokens"}


def test_the_packages_export_lazily_every_name_they_list():
    """``dream_trainer`` and ``dream_trainer.data`` import each exported name on first use:
    each name of ``__all__`` resolves to its module's object, ``__dir__`` lists it, a
    submodule is reachable as an attribute, and a name nobody exports is an AttributeError."""
    import importlib

    import pytest

    for package in ("dream_trainer", "dream_trainer.data"):
        module = importlib.import_module(package)
        exported = sorted(name for names in module._EXPORTS.values() for name in names)
        assert sorted(module.__all__) == exported
        for name in module.__all__:
            assert getattr(module, name) is not None and name in dir(module)
        with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'not_a_name'"):
            module.not_a_name
    assert dream_trainer.callbacks.__name__ == "dream_trainer.callbacks"


def test_the_data_preparation_tool_runs_without_torch():
    """``python -m dream_trainer.data.prepare`` imports neither torch nor the trainer: its
    memory is the data path's (the import alone was about 300 MB of a 340 MB peak)."""
    import subprocess
    import sys

    code = ("import sys, dream_trainer.data.prepare, dream_trainer.data.tokens; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('dream_trainer.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
